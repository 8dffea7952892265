"""`python -m services.model` as a process: it serves a repository in which one model is bad, reports that
model UNAVAILABLE with its reason, and serves the others."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import response_tensors
from tests.conftest import request_for
from tests.e2e.conftest import start_service, wait_serving
from tests.model_files import add_model, reference, write_onnx

pytestmark = pytest.mark.e2e


def test_the_service_serves_the_good_models_beside_a_bad_one(tmp_path: Path) -> None:
    root = tmp_path / "repository"
    add_model(root, "onnx", "good", {"1": 1})
    write_onnx(root / "plain" / "1" / "model.onnx", 2)  # no config: auto-complete
    (root / "bad" / "1").mkdir(parents=True)
    (root / "bad" / "1" / "model.onnx").write_bytes(b"truncated")
    service = start_service(
        "model",
        ["-m", "services.model", "--model-repository", str(root), "--default-max-batch-size", "2"],
        tmp_path,
    )
    try:
        wait_serving(service)
        with grpc.insecure_channel(service.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10)
            states = {m.name: (m.state, m.reason) for m in index.models}
            assert states["good"] == ("READY", "") and states["plain"] == ("READY", "")
            assert states["bad"][0] == "UNAVAILABLE" and "not a valid ONNX model" in states["bad"][1]
            assert (
                stub.ModelConfig(pb.ModelConfigRequest(name="plain"), timeout=10).config.max_batch_size == 2
            )
            x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
            reply = stub.ModelInfer(request_for("good", X=x), timeout=10)
            got = response_tensors(reply)["Y"].to_array()
            np.testing.assert_allclose(
                got, reference(root / "good" / "1" / "model.onnx", {"X": x})["Y"], rtol=1e-5
            )
    finally:
        assert service.stop() == 0

"""A stage service process serving a repository of python models, as a user starts it."""

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
from tests.stages import TRITON_ADD_SUB_CONFIG, TRITON_ADD_SUB_MODEL, example_repository, write_model

pytestmark = pytest.mark.e2e

LOAD = ["--load-model", "add_sub", "--load-model", "refcnn_postprocess"]


def test_a_stage_process_serves_the_models_it_is_told_to(tmp_path: Path) -> None:
    root = example_repository(tmp_path / "repository", ["refcnn_postprocess", "digits_postprocess"])
    write_model(root, "add_sub", TRITON_ADD_SUB_MODEL, TRITON_ADD_SUB_CONFIG)
    write_model(root, "broken", "raise ImportError('not today')\n")
    process = start_service(
        "postprocess",
        [
            "-m",
            "services.postprocess",
            "--model-repository",
            str(root),
            "--model-control-mode",
            "explicit",
            *LOAD,
        ],
        tmp_path,
    )
    try:
        wait_serving(process)
        with grpc.insecure_channel(process.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10)
            assert {(m.name, m.state) for m in index.models} == {
                ("add_sub", "READY"),
                ("refcnn_postprocess", "READY"),
            }
            a, b = np.random.default_rng(1).random((2, 4), dtype=np.float32)
            reply = stub.ModelInfer(request_for("add_sub", INPUT0=a, INPUT1=b), timeout=10)
            np.testing.assert_allclose(response_tensors(reply)["OUTPUT1"].to_array(), a - b)

            # Named or not at start, a model of the repository loads on request; a bad one is refused.
            stub.RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(model_name="digits_postprocess"), timeout=30
            )
            logits = np.eye(10, dtype=np.float32)[[3]]
            reply = stub.ModelInfer(request_for("digits_postprocess", LOGITS=logits), timeout=10)
            assert response_tensors(reply)["LABEL"].to_array().tolist() == [[3]]
            with pytest.raises(grpc.RpcError) as caught:
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="broken"), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert str(root / "broken" / "1" / "model.py") in caught.value.details()
            assert "ImportError: not today" in caught.value.details()
    finally:
        assert process.stop() == 0


def test_each_python_service_loads_only_the_models_its_place_in_the_ensembles_gives_it(
    tmp_path: Path,
) -> None:
    # Without --load-model, the preprocess service serves the Python models that run before the model
    # service's in the repository's ensembles, the postprocess service those after: each is loaded once.
    root = example_repository(tmp_path / "repository", ["refcnn_preprocess", "refcnn_postprocess"])
    (root / "classify").mkdir()
    (root / "classify" / "config.pbtxt").write_text(
        'name: "classify" platform: "ensemble" max_batch_size: 8\n'
        'input [{ name: "IMAGE" data_type: TYPE_UINT8 dims: [3, 64, 64] }]\n'
        'output [{ name: "LABEL" data_type: TYPE_INT64 dims: [1] }, { name: "PROB" data_type: TYPE_FP32 dims: [1] }]\n'
        "ensemble_scheduling { step [\n"
        '  { model_name: "refcnn_preprocess" model_version: -1 input_map { key: "IMAGE" value: "IMAGE" }'
        ' output_map { key: "INPUT" value: "pixels" } },\n'
        '  { model_name: "refcnn_cnn" model_version: -1 input_map { key: "INPUT" value: "pixels" }'
        ' output_map { key: "LOGITS" value: "logits" } },\n'
        '  { model_name: "refcnn_postprocess" model_version: -1 input_map { key: "LOGITS" value: "logits" }'
        ' output_map [{ key: "LABEL" value: "LABEL" }, { key: "PROB" value: "PROB" }] }\n'
        "] }\n"
    )
    env = {"PIPELINE_ENSEMBLES": str(tmp_path / "no-yaml-ensembles")}
    served = {}
    for service in ("preprocess", "postprocess"):
        process = start_service(
            service, ["-m", f"services.{service}", "--model-repository", str(root)], tmp_path, env
        )
        try:
            wait_serving(process)
            with grpc.insecure_channel(process.address) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10)
                served[service] = {(m.name, m.state) for m in index.models}
        finally:
            assert process.stop() == 0
    assert served == {
        "preprocess": {("refcnn_preprocess", "READY")},
        "postprocess": {("refcnn_postprocess", "READY")},
    }

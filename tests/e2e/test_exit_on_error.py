"""The router process with an ensemble file that does not load: it exits (Triton's `--exit-on-error`
default), or, with `PIPELINE_EXIT_ON_ERROR=false`, serves the others and lists the failed one; with
`PIPELINE_REPOSITORY_POLL_SECS` it serves the file once fixed."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import request_for
from tests.e2e.conftest import start_service, wait_serving

pytestmark = pytest.mark.e2e

ENSEMBLE = """
stages:
  post: {{address: "{address}"}}
inputs: [{{name: LOGITS, datatype: FP32, shape: [-1, 10]}}]
outputs: [{{name: LABEL, datatype: INT64, shape: [-1, 1]}}]
steps:
  - {{model_name: refcnn_postprocess, stage: post, input_map: {{LOGITS: LOGITS}}, output_map: {{LABEL: LABEL}}}}
"""


def test_a_bad_file_stops_the_router_unless_exit_on_error_is_false(tmp_path):
    stage = start_service("postprocess", ["-m", "services.postprocess"], tmp_path)
    router = None
    try:
        wait_serving(stage)
        folder = tmp_path / "ensembles"
        folder.mkdir()
        (folder / "top1.yaml").write_text(ENSEMBLE.format(address=stage.address))
        (folder / "broken.yaml").write_text("inputs: [")
        command = ["-m", "pipeline", "router", "--ensembles", str(folder)]
        with pytest.raises(RuntimeError, match=r"(?s)router exited with 2: .*broken\.yaml: line 1"):
            start_service("router", command, tmp_path)

        env = {"PIPELINE_EXIT_ON_ERROR": "false", "PIPELINE_REPOSITORY_POLL_SECS": "0.1"}
        router = start_service("router", command, tmp_path, env)
        wait_serving(router)
        with grpc.insecure_channel(router.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            logits = np.eye(10, dtype=np.float32)[[3]]
            reply = stub.ModelInfer(request_for("top1", LOGITS=logits), timeout=30)
            assert np.frombuffer(reply.raw_output_contents[0], np.int64).tolist() == [3]
            index = {m.name: m for m in stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10).models}
            assert index["broken"].state == "UNAVAILABLE" and "invalid YAML" in index["broken"].reason
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(request_for("broken", LOGITS=logits), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "invalid YAML" in info.value.details()

            # Fixed while the router runs: served once the router has read it again.
            (folder / "broken.yaml").write_text(ENSEMBLE.format(address=stage.address))
            deadline = time.monotonic() + 30
            while not stub.ModelReady(pb.ModelReadyRequest(name="broken"), timeout=10).ready:
                assert time.monotonic() < deadline, "broken.yaml not served within 30 s of its fix"
                time.sleep(0.05)
            reply = stub.ModelInfer(request_for("broken", LOGITS=logits), timeout=30)
            assert np.frombuffer(reply.raw_output_contents[0], np.int64).tolist() == [3]
        assert router.stop() == 0
    finally:
        if router is not None:
            router.stop()
        stage.stop()

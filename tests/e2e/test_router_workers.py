"""`pipeline router --workers 2`: two processes on one port, one view of their statistics and metrics."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import request_for
from tests.e2e.conftest import start_service, wait_serving

pytestmark = pytest.mark.e2e

ENSEMBLE = """
name: top1
stages:
  post: {{address: "{address}"}}
inputs: [{{name: LOGITS, datatype: FP32, shape: [-1, 10]}}]
outputs: [{{name: LABEL, datatype: INT64, shape: [-1, 1]}}]
steps:
  - {{model_name: refcnn_postprocess, stage: post, input_map: {{LOGITS: LOGITS}}, output_map: {{LABEL: LABEL}}}}
"""


def test_two_workers_share_the_port_and_answer_for_each_other(tmp_path):
    stage = start_service("postprocess", ["-m", "services.postprocess"], tmp_path)
    router = None
    try:
        wait_serving(stage)
        (tmp_path / "ensembles").mkdir()
        (tmp_path / "ensembles" / "top1.yaml").write_text(ENSEMBLE.format(address=stage.address))
        metrics_file = tmp_path / "router.metrics"
        router = start_service(
            "router",
            [
                *("-m", "pipeline", "router", "--workers", "2", "--ensembles", str(tmp_path / "ensembles")),
                *("--metrics-port", "0", "--metrics-port-file", str(metrics_file)),
            ],
            tmp_path,
        )
        wait_serving(router)
        logits = np.eye(10, dtype=np.float32)[[3]]
        # SO_REUSEPORT spreads connections: 16 channels of their own reach both workers (all 16 on one
        # worker has odds of 2 in 65,536).
        channels = [
            grpc.insecure_channel(router.address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(16)
        ]
        try:
            for channel in channels:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                for _ in range(5):
                    reply = stub.ModelInfer(request_for("top1", LOGITS=logits), timeout=30)
                    assert np.frombuffer(reply.raw_output_contents[0], np.int64).tolist() == [3]
            # Whichever worker answers, it answers for both.
            for channel in channels[:4]:
                stats = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                    pb.ModelStatisticsRequest(name="top1"), timeout=10
                )
                assert stats.model_stats[0].inference_count == 80
        finally:
            for channel in channels:
                channel.close()
        port = int(metrics_file.read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        served = {}
        for family in text_string_to_metric_families(text):
            if family.name == "pipeline_requests":
                for sample in family.samples:
                    if sample.name == "pipeline_requests_total" and sample.labels["model"] == "top1":
                        served[sample.labels["worker"]] = sample.value
        assert set(served) == {"0", "1"} and all(served.values()), served
        assert sum(served.values()) == 80
        assert router.stop() == 0
    finally:
        if router is not None:
            router.stop()
        stage.stop()

"""`python -m bench.scaling` runs as docs/deployment/scaling.md says: the real model service on the
repository, a slow replica through `bench.model_stage`, and figures for every process. A benchmark that no
longer starts is found here, not when someone next needs its figures (the timings themselves are not
checked)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import request_for
from tests.e2e.conftest import start_service, wait_serving

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_the_scaling_benchmark_serves_the_slow_pair_and_reports_every_process(tmp_path, model_dir):
    results = tmp_path / "results"
    finished = subprocess.run(
        [
            *(sys.executable, "-m", "bench.scaling", str(results)),
            *("--variants", "embeddings-model2-slow", "--duration", "3", "--model-dir", str(model_dir)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    figure = json.loads(finished.stdout.splitlines()[0])
    assert figure["variant"] == "embeddings-model2-slow"
    assert figure["errors"] == {} and figure["infer_per_s"] > 0, figure
    assert len(figure["replica_calls"]) == 2 and min(figure["replica_calls"]) > 0, "both replicas served"
    assert set(figure["cores"]) == {
        "router",
        "preprocess",
        "postprocess",
        "model-0",
        "model-1",
        "client",
        "machine",
        "stolen",
    }
    assert figure["cores"]["model-0"] > 0 and figure["cores"]["model-1"] > 0
    report = json.loads((results / "embeddings-model2-slow.json").read_text())["results"][0]
    assert report["ok"] > 0 and report["stages"]["minilm_encoder"]["execution_count"] > 0


def test_the_slow_replica_answers_later(tmp_path, model_dir):
    """`bench.model_stage --delay-ms` is the model service with a delay on every execution."""
    slow = start_service(
        "model",
        ["-m", "bench.model_stage", "--delay-ms", "300", "--model-dir", str(model_dir)],
        tmp_path,
    )
    try:
        wait_serving(slow)
        with grpc.insecure_channel(slow.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            request = request_for("refcnn_cnn", INPUT=np.zeros((1, 3, 64, 64), np.float32))
            started = time.perf_counter()
            reply = stub.ModelInfer(request, timeout=60)
            assert time.perf_counter() - started >= 0.3, "the delay is on every execution"
            assert reply.outputs[0].name == "LOGITS" and list(reply.outputs[0].shape) == [1, 10]
    finally:
        slow.stop()

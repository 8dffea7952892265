"""The refcnn ensemble through the real processes, and `pipeline bench` against the router."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.tools.client import InferenceClient
from tests.e2e.conftest import REPO
from tests.stages import example_stage

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", autouse=True)
def refcnn_ready(pipeline) -> None:
    """Wait until the router says the ensemble is ready: its stages load their models one after another."""
    deadline = time.monotonic() + 120
    with InferenceClient(pipeline.router.address) as client:
        while not client.stub.ModelReady(pb.ModelReadyRequest(name="refcnn"), timeout=5).ready:
            assert time.monotonic() < deadline, "refcnn not ready within 120 s"
            time.sleep(0.2)


def _in_process(images: np.ndarray, model_dir: Path) -> dict[str, np.ndarray]:
    """The three stages composed in-process, the model in ONNX Runtime on the repository's own file
    (tests/unit/test_refcnn.py ties the stages to the reference)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_dir / "refcnn_cnn" / "1" / "model.onnx"))
    pixels = example_stage("refcnn_preprocess").infer({"IMAGE": images})["PIXELS"]
    (logits,) = session.run(["LOGITS"], {"INPUT": pixels})
    return example_stage("refcnn_postprocess").infer({"LOGITS": logits})


@pytest.mark.parametrize("batch", [1, 5, 64])
def test_the_pipeline_gives_the_in_process_results(pipeline, model_dir, batch: int) -> None:
    images = np.random.default_rng(batch).integers(0, 256, size=(batch, 3, 64, 64), dtype=np.uint8)
    with InferenceClient(pipeline.router.address) as client:
        out = client.infer("refcnn", {"IMAGE": images}, timeout=60)
    expected = _in_process(images, model_dir)
    assert out["LABEL"].dtype == np.int64 and out["LABEL"].shape == (batch, 1)
    assert out["PROB"].dtype == np.float32 and out["PROB"].shape == (batch, 1)
    np.testing.assert_array_equal(out["LABEL"], expected["LABEL"])
    np.testing.assert_allclose(out["PROB"], expected["PROB"], rtol=1e-5, atol=1e-6)


def test_bench_drives_the_router(pipeline, tmp_path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            *(
                sys.executable,
                "-m",
                "pipeline",
                "bench",
                "--url",
                pipeline.router.address,
                "--model",
                "refcnn",
            ),
            *(
                "--concurrency",
                "1,4",
                "--warmup",
                "0.5",
                "--duration",
                "1",
                "--no-progress",
                "--json",
                str(out),
            ),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "concurrency" in done.stdout and "p99 ms" in done.stdout
    report = json.loads(out.read_text())
    assert report["inputs"] == [{"name": "IMAGE", "datatype": "UINT8", "shape": [1, 3, 64, 64]}]
    for result in report["results"]:
        assert result["sent"] == result["ok"] > 0 and result["errors"] == {}

"""`pipeline run` with tritonserver's flags, in Triton's value syntax, as a user moving over types them: each
reaches the processes that act on it."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from examples.digit_images import encode
from examples.models.digits import load_split
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.tools.client import InferenceClient, bytes_batch
from tests.e2e.conftest import REPO
from tests.e2e.test_processes import launch

pytestmark = pytest.mark.e2e

#: An ensemble whose model no stage serves: UNAVAILABLE while the router serves.
ORPHAN = """
stages:
  model: {address: "${MODEL_ADDRESS:-127.0.0.1:8102}"}
inputs: [{name: X, datatype: FP32, shape: [-1, 4]}]
outputs: [{name: Y, datatype: FP32, shape: [-1, 3]}]
steps:
  - {model_name: absent_model, stage: model, input_map: {X: X}, output_map: {Y: Y}}
"""


def test_pipeline_run_takes_tritonservers_flags(tmp_path, model_dir):
    folder = tmp_path / "ensembles"
    folder.mkdir()
    (folder / "orphan.yaml").write_text(ORPHAN)
    (folder / "broken.yaml").write_text("inputs: [")
    output: list[str] = []
    flags = ["--model-control-mode=explicit", "--load-model=digits", "--load-model=orphan"]
    flags += ["--load-model=broken", "--strict-readiness=false", "--exit-on-error=false", "--log-verbose=1"]
    process, address, _, pids, _ = launch(
        tmp_path, model_dir, "--ensembles", str(folder), *flags, output=output
    )
    # Verbose logs keep coming: read them, or the pipe fills and the services block writing.
    threading.Thread(target=output.extend, args=(process.stdout,), daemon=True).start()
    try:
        # --log-verbose=1: every service logs at DEBUG level.
        assert {"router", *pids} <= {line.split()[2] for line in output if " DEBUG " in line}, "".join(output)
        with InferenceClient(address) as client:
            stub = client.stub
            # --exit-on-error=false: the broken file did not stop the router; it is listed with the reason.
            index = {m.name: m for m in stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10).models}
            assert index["broken"].state == "UNAVAILABLE" and "invalid YAML" in index["broken"].reason
            # --strict-readiness=false: ready although an ensemble it serves is not available.
            assert index["orphan"].state == "UNAVAILABLE"
            assert stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
            # --load-model=digits: the ensemble and the models its steps call, on their stages; nothing else.
            _, _, x_test, y_test = load_split()
            image = {"IMAGE": bytes_batch([encode(x_test[0])], (-1, 1))}
            assert client.infer("digits", image, timeout=30)["LABEL"][0, 0] == y_test[0]
            ready = {name for name, model in index.items() if model.state == "READY"}
            assert ready == {"digits", "digits_preprocess", "digits_cnn", "digits_postprocess"}, index
            assert "refcnn" not in index and "embeddings" not in index  # ensembles not selected: not served
            # --model-control-mode=explicit, at the router and the stages: a model loads on request.
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="refcnn_cnn"), timeout=120)
            assert stub.ModelReady(pb.ModelReadyRequest(name="refcnn_cnn"), timeout=10).ready
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    assert process.returncode == 0, "".join(output[-50:])


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--exit-on-error=maybe"],
            "argument --exit-on-error: expected true or false (or 1 or 0), got 'maybe'",
        ),
        (["--load-model=nothing_here"], "--load-model: no model or ensemble named 'nothing_here'"),
        (["--log-verbose=-1"], "argument --log-verbose: must be at least 0, got -1"),
    ],
)
def test_pipeline_run_refuses_what_it_cannot_take(flags, words):
    command = [sys.executable, "-m", "pipeline", "run", "--model-dir", str(REPO / "model_repository"), *flags]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and words in done.stdout + done.stderr, done.stdout + done.stderr

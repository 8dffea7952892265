"""`pipeline run` through both doors: the compiled front (`--front compiled`, pipeline-front) and the router's
own Python gRPC server (`--front python`), with Triton's Python client: metadata, configuration, unary
inference, a stream, system shared memory, statistics and an error, all answered alike."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from pipeline.router import front
from tests.e2e.test_digits import held_out_files
from tests.e2e.test_processes import launch

pytestmark = pytest.mark.e2e

TRITON_CLIENT = r"""
import json, queue, sys
import numpy as np
import tritonclient.grpc as triton
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

url, *paths = sys.argv[1:]
client = triton.InferenceServerClient(url)
report = {"live": client.is_server_live(), "ready": client.is_server_ready(),
          "extensions": client.get_server_metadata(as_json=True)["extensions"]}
report["inputs"] = client.get_model_metadata("digits", as_json=True)["inputs"]
report["steps"] = [s["model_name"] for s in
                   client.get_model_config("digits", as_json=True)["config"]["ensemble_scheduling"]["step"]]
images = np.array([[open(p, "rb").read()] for p in paths], dtype=np.object_)
image = triton.InferInput("IMAGE", list(images.shape), "BYTES")
image.set_data_from_numpy(images)
result = client.infer("digits", [image], request_id="unary-1", outputs=[triton.InferRequestedOutput("LABEL")])
report["labels"] = result.as_numpy("LABEL")[:, 0].tolist()
report["id"] = result.get_response().id

# A stream: one request per image, answered in any order, each with its id.
answers = queue.Queue()
client.start_stream(callback=lambda result, error: answers.put((result, error)))
for i, path in enumerate(paths):
    one = triton.InferInput("IMAGE", [1, 1], "BYTES")
    one.set_data_from_numpy(np.array([[open(path, "rb").read()]], dtype=np.object_))
    client.async_stream_infer("digits", [one], request_id=str(i))
streamed = {}
for _ in paths:
    result, error = answers.get(timeout=60)
    assert error is None, error
    streamed[result.get_response().id] = int(result.as_numpy("LABEL")[0, 0])
client.stop_stream()
report["streamed"] = [streamed[str(i)] for i in range(len(paths))]

# System shared memory: the logits in, the label out.
logits = np.eye(10, dtype=np.float32)[[7]]
region = shm.create_shared_memory_region("front_in", "/front_in", logits.nbytes)
out_region = shm.create_shared_memory_region("front_out", "/front_out", 8)
try:
    shm.set_shared_memory_region(region, [logits])
    client.register_system_shared_memory("front_in", "/front_in", logits.nbytes)
    client.register_system_shared_memory("front_out", "/front_out", 8)
    tensor = triton.InferInput("LOGITS", [1, 10], "FP32")
    tensor.set_shared_memory("front_in", logits.nbytes)
    wanted = triton.InferRequestedOutput("LABEL")
    wanted.set_shared_memory("front_out", 8)
    client.infer("digits_postprocess", [tensor], outputs=[wanted])
    report["shared_label"] = int(shm.get_contents_as_numpy(out_region, np.int64, [1, 1])[0, 0])
    report["regions"] = sorted(client.get_system_shared_memory_status(as_json=True)["regions"])
    client.unregister_system_shared_memory()
finally:
    shm.destroy_shared_memory_region(region)
    shm.destroy_shared_memory_region(out_region)

stats = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
report["inference_count"] = int(stats.get("inference_count", 0))
try:
    client.infer("no_such_model", [image])
except InferenceServerException as err:
    report["error"] = [err.status(), err.message()]
print(json.dumps(report))
"""


@pytest.mark.parametrize("door", ["compiled", "python"])
def test_tritons_client_through_either_door(door, tmp_path, model_dir):
    if door == "compiled" and front.binary() is None:
        pytest.skip("pipeline-front is not built (make front)")
    launched = launch(tmp_path, model_dir, "--front", door)
    try:
        paths, truth = held_out_files(tmp_path, 4)
        done = subprocess.run(
            [sys.executable, "-c", TRITON_CLIENT, launched.address, *paths],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["live"] and report["ready"]
        assert "system_shared_memory" in report["extensions"]
        assert report["inputs"] == [{"name": "IMAGE", "datatype": "BYTES", "shape": ["-1", "1"]}]
        assert report["steps"] == ["digits_preprocess", "digits_cnn", "digits_postprocess"]
        assert report["labels"] == truth and report["id"] == "unary-1"
        assert report["streamed"] == truth
        assert report["shared_label"] == 7 and report["regions"] == ["front_in", "front_out"]
        assert report["inference_count"] == 2 * len(truth)
        status, message = report["error"]
        assert status == "StatusCode.NOT_FOUND" and "unknown model 'no_such_model'" in message
    finally:
        launched.process.send_signal(signal.SIGTERM)
        launched.process.communicate(timeout=60)
    assert launched.process.returncode == 0

"""`make run MODEL_DIR=...` on a Triton repository the project has never seen, written here as a user writes
one: a Python-backend stage before an ONNX model and one after it, chained by a `config.pbtxt` ensemble.
Nothing else is served (no example model is written into it, no example ensemble waited for), and Triton's
own client gets the same outputs as the same files run in-process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.conftest import REPO
from tests.model_files import add_model, reference

pytestmark = pytest.mark.e2e

#: Triton's Python backend, as its users write it: FEATURES doubled.
DOUBLE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("DOUBLED", pb_utils.get_input_tensor_by_name(r, "RAW").as_numpy() * 2)]
            )
            for r in requests
        ]
"""
DOUBLE_CONFIG = """
name: "double"
backend: "python"
max_batch_size: 8
input [ { name: "RAW", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "DOUBLED", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""
#: A softmax over Y.
SOFTMAX = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            y = pb_utils.get_input_tensor_by_name(request, "Y").as_numpy()
            e = np.exp(y - y.max(axis=1, keepdims=True))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PROB", e / e.sum(axis=1, keepdims=True))]))
        return responses
"""
SOFTMAX_CONFIG = """
name: "softmax"
backend: "python"
max_batch_size: 8
input [ { name: "Y", data_type: TYPE_FP32, dims: [ 3 ] } ]
output [ { name: "PROB", data_type: TYPE_FP32, dims: [ 3 ] } ]
"""
ENSEMBLE = """
name: "classify"
platform: "ensemble"
max_batch_size: 8
input [ { name: "FEATURES", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "PROBABILITIES", data_type: TYPE_FP32, dims: [ 3 ] } ]
ensemble_scheduling {
  step [
    { model_name: "double" model_version: -1
      input_map { key: "RAW" value: "FEATURES" } output_map { key: "DOUBLED" value: "doubled" } },
    { model_name: "linear" model_version: -1
      input_map { key: "X" value: "doubled" } output_map { key: "Y" value: "logits" } },
    { model_name: "softmax" model_version: -1
      input_map { key: "Y" value: "logits" } output_map { key: "PROB" value: "PROBABILITIES" } }
  ]
}
"""


def write_repository(root: Path) -> Path:
    add_model(root, "onnx", "linear", {"1": 21})
    for name, source, config in (("double", DOUBLE, DOUBLE_CONFIG), ("softmax", SOFTMAX, SOFTMAX_CONFIG)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(source)
        (root / name / "config.pbtxt").write_text(config)
    (root / "classify" / "1").mkdir(parents=True)
    (root / "classify" / "config.pbtxt").write_text(ENSEMBLE)
    return root


#: Every port the OS picks, and no Prometheus port of the router's, so nothing clashes with a neighbour.
PORTS = {
    "PIPELINE_ROUTER_PORT": "0",
    "PIPELINE_HTTP_PORT": "0",
    "PIPELINE_PREPROCESS_PORT": "0",
    "PIPELINE_MODEL_PORT": "0",
    "PIPELINE_POSTPROCESS_PORT": "0",
    "PIPELINE_ROUTER_METRICS_PORT": "off",
}

#: Triton's Python client, in a process of its own (it registers Triton's copy of the protocol's messages):
#: classify the features of a .npy file, write the probabilities beside it, print what the server says.
TRITON_CLIENT = r"""
import json, sys
import numpy as np
import tritonclient.grpc as triton

url, features_file, out_file = sys.argv[1:]
client = triton.InferenceServerClient(url)
x = np.load(features_file)
features = triton.InferInput("FEATURES", list(x.shape), "FP32")
features.set_data_from_numpy(x)
result = client.infer("classify", [features], client_timeout=30)
np.save(out_file, result.as_numpy("PROBABILITIES"))
report = {
    "ready": client.is_server_ready(),
    "platform": client.get_model_metadata("classify", as_json=True)["platform"],
    "index": [[m["name"], m.get("state", "")] for m in client.get_model_repository_index(as_json=True)["models"]],
}
print(json.dumps(report))
"""


def test_make_run_serves_an_unseen_triton_repository_alone(tmp_path):
    root = write_repository(tmp_path / "my_repo")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    venv = Path(sys.prefix)
    # What the user types; `-o` keeps make from reinstalling an installed environment.
    make = ["make", "--no-print-directory", "-o", str(venv / ".installed"), "run", f"MODEL_DIR={root}"]
    process = subprocess.Popen(
        [*make, f"VENV={venv}"],
        cwd=REPO,
        env={**os.environ, **PORTS},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job: Ctrl-C reaches all
    )
    lines = []
    try:
        deadline = time.monotonic() + 180
        for line in process.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("pipeline: serving"):
                break
            assert time.monotonic() < deadline, "".join(lines)
        else:
            raise AssertionError(f"make run exited early:\n{''.join(lines)}")
        assert line.startswith("pipeline: serving classify on "), line
        address = re.search(r" on (\S+) \(gRPC", line).group(1)

        x = np.random.default_rng(5).standard_normal((5, 4)).astype(np.float32)
        np.save(tmp_path / "features.npy", x)
        asked = [tmp_path / "features.npy", tmp_path / "probabilities.npy"]
        done = subprocess.run(
            [sys.executable, "-c", TRITON_CLIENT, address, *map(str, asked)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        logits = reference(root / "linear" / "1" / "model.onnx", {"X": 2 * x})["Y"]
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        np.testing.assert_allclose(np.load(asked[1]), e / e.sum(axis=1, keepdims=True), rtol=1e-5)
        assert report["ready"]  # strict readiness: every ensemble of the repository is served
        assert report["platform"] == "ensemble"
        # Just the user's repository: its ensemble and its three models, each READY.
        assert sorted(map(tuple, report["index"])) == [
            ("classify", "READY"),
            ("double", "READY"),
            ("linear", "READY"),
            ("softmax", "READY"),
        ]
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C
        rest, _ = process.communicate(timeout=60)
        assert "Traceback" not in rest, rest
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    # Nothing was written into it (the example models go only into the examples' repository).
    assert sorted(p.relative_to(root) for p in root.rglob("*") if "__pycache__" not in p.parts) == before

"""The documentation's "Serve your own model" (docs/serving/index.md), as a new user runs it: a ResNet-18 exported to ONNX, two Python stages
and a Triton ensemble config copied into the repository, served by `pipeline run`, and classified with
Triton's client; the answer matches the same three steps run in this process."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from tests.docs_examples import examples
from tests.e2e.conftest import REPO
from tests.e2e.test_processes import launch

pytestmark = pytest.mark.e2e


def walkthrough_blocks() -> tuple[str, str]:
    """The walkthrough's shell commands and its Python client, the blocks the docs mark
    `<!-- runnable: walkthrough -->`."""
    shell, python = examples("walkthrough")
    assert (shell.language, python.language) == ("sh", "python"), (shell.name, python.name)
    return shell.code, python.code


def reference(repository: Path, photo: bytes) -> tuple[int, float]:
    """The ensemble's three steps in this process: the preprocess stage, ONNX Runtime, softmax."""
    import onnxruntime

    entry = ModelRepository(repository).read("resnet18_preprocess")
    (instance,) = PythonBackend().prepare(entry, "1").instances
    instance.load()
    pixels = instance.run({"IMAGE": np.array([[photo]], dtype=object)})["PIXELS"]
    session = onnxruntime.InferenceSession(str(repository / "resnet18" / "1" / "model.onnx"))
    logits = session.run(["logits"], {"input": pixels})[0][0].astype(np.float64)
    probabilities = np.exp(logits - logits.max())
    probabilities /= probabilities.sum()
    return int(probabilities.argmax()), float(probabilities.max())


def test_serve_your_own_model_as_the_docs_say(tmp_path, model_dir):
    repository = tmp_path / "model_repository"
    shutil.copytree(model_dir, repository)  # the tree's repository, its example models built
    shell, python = walkthrough_blocks()
    commands = [line.split("#")[0].strip() for line in shell.splitlines()]
    assert commands[-1] == "make run"  # started below on ports the OS picks, as `make run` starts it
    script = "\n".join(commands[:-1]).replace(".venv/bin/python", sys.executable)
    done = subprocess.run(
        ["bash", "-e", "-c", script.replace("model_repository", str(repository))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert (repository / "resnet18" / "1" / "model.onnx").is_file()
    assert not (repository / "resnet18" / "config.pbtxt").exists(), "auto-complete: no config is needed"

    photo = io.BytesIO()
    rng = np.random.default_rng(7)
    Image.fromarray(rng.integers(0, 256, (300, 420, 3), dtype=np.uint8)).save(photo, "JPEG")
    (tmp_path / "photo.jpg").write_bytes(photo.getvalue())

    process, address, _, _, _ = launch(tmp_path, repository)
    try:
        assert process.poll() is None
        client = subprocess.run(
            [sys.executable, "-c", python.replace("127.0.0.1:8001", address)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert client.returncode == 0, client.stderr
        found = re.fullmatch(r"\[\[(\d+)\]\] \[\[([0-9.e-]+)\]\]", client.stdout.strip())
        assert found, client.stdout
        label, score = reference(repository, photo.getvalue())
        assert int(found.group(1)) == label
        assert float(found.group(2)) == pytest.approx(score, rel=1e-3)
    finally:
        process.terminate()
        process.communicate(timeout=60)

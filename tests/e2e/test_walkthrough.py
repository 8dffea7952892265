"""The "Serve your own model" walkthrough (docs/serving/index.md, and the README's copy of it), as a new user
runs it: a repository of their own made with a ResNet-18 exported to ONNX, two Python stages and a Triton
ensemble config, served by `pipeline run`; in a second terminal the images the project writes, one classified
with Triton's client; the answer matches the same three steps run in this process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from tests.docs_examples import examples
from tests.e2e.conftest import REPO
from tests.e2e.test_processes import launch

pytestmark = pytest.mark.e2e


#: The pages that show the walkthrough, each with the same blocks.
PAGES = ("README.md", "docs/serving/index.md")


def walkthrough_blocks() -> tuple[str, str, str]:
    """The blocks the pages mark `<!-- runnable: walkthrough -->`: the first terminal's shell commands, the
    second terminal's, and its Python client. Every page shows the same ones."""
    shown: dict[str, list[tuple[str, str]]] = {}
    for example in examples("walkthrough"):
        shown.setdefault(example.page, []).append((example.language, example.code))
    assert sorted(shown) == sorted(PAGES), sorted(shown)
    first, *others = (shown[page] for page in PAGES)
    for page, blocks in zip(PAGES[1:], others, strict=True):
        assert blocks == first, f"{page}'s walkthrough differs from {PAGES[0]}'s"
    assert [language for language, _ in first] == ["sh", "sh", "python"], first
    setup, second_terminal, client = (code for _, code in first)
    return setup, second_terminal, client


def as_here(commands: str) -> str:
    """Shell commands as this checkout runs them: its interpreter for `.venv/bin/python`."""
    return commands.replace(".venv/bin/python", sys.executable)


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


def test_serve_your_own_model_as_the_docs_say(tmp_path):
    repository = tmp_path / "my_repository"  # the user's own folder, made by the walkthrough
    setup, second_terminal, python = walkthrough_blocks()
    commands = [line.split("#")[0].strip() for line in setup.splitlines()]
    assert commands[-1] == "make run MODEL_DIR=my_repository"  # started below on ports the OS picks
    script = as_here("\n".join(commands[:-1])).replace("my_repository", str(repository))
    done = subprocess.run(["bash", "-e", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in repository.iterdir()) == [
        "resnet18",
        "resnet18_classify",
        "resnet18_postprocess",
        "resnet18_preprocess",
    ]
    assert (repository / "resnet18" / "1" / "model.onnx").is_file()
    assert not (repository / "resnet18" / "config.pbtxt").exists(), "auto-complete: no config is needed"

    process, address, _, _, _ = launch(tmp_path, repository)
    try:
        assert process.poll() is None
        # The second terminal, in a folder of its own here; `python -m examples...` as from the clone's root.
        terminal = tmp_path / "second terminal"
        terminal.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        images = subprocess.run(
            ["bash", "-e", "-c", as_here(second_terminal)],
            cwd=terminal,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert images.returncode == 0, images.stderr
        client = subprocess.run(
            [sys.executable, "-c", python.replace("127.0.0.1:8001", address)],
            cwd=terminal,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert client.returncode == 0, client.stderr
        found = re.fullmatch(r"\[\[(\d+)\]\] \[\[([0-9.e-]+)\]\]", client.stdout.strip())
        assert found, client.stdout
        label, score = reference(repository, (terminal / "seven.jpg").read_bytes())
        assert int(found.group(1)) == label
        assert float(found.group(2)) == pytest.approx(score, rel=1e-3)
    finally:
        process.terminate()
        process.communicate(timeout=60)

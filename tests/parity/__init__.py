"""The Triton parity check: a repository of Python-backend models (`repository/`), the requests asked of it
(`exchange`), the real Triton server's answers (`triton_answers.json`, written by `record`), and the test that
asks this project the same (`tests/e2e/test_triton_parity.py`)."""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE / "repository"
#: The models that run one of the shared sources of `models/` (their configs' parameters say what each does).
SHARED_SOURCES = {
    "add_one": "add_one.py",
    "add_one_ranked": "add_one.py",
    "bls_forward": "bls_caller.py",
    "bls_output_names": "bls_caller.py",
    "bls_report_error": "bls_caller.py",
    "bls_report_missing": "bls_caller.py",
    "bls_report_ok": "bls_caller.py",
    "bls_report_raise": "bls_caller.py",
    "bls_report_wrong_input": "bls_caller.py",
    "bls_reraise": "bls_caller.py",
    "bls_fan_out": "bls_fan_out.py",
    "bls_fan_out_failing": "bls_fan_out.py",
}


def lay_out(dest: Path) -> Path:
    """The parity repository in `dest` as both servers serve it: `repository/`, with each shared source
    copied into the version folder of the models that run it."""
    shutil.copytree(REPOSITORY, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for model, source in SHARED_SOURCES.items():
        version = dest / model / "1"
        version.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HERE / "models" / source, version / "model.py")
    return dest

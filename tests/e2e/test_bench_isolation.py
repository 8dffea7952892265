"""`python -m bench.isolation` runs as docs/reliability.md says, and what it measures holds: with one model
of a stage slow, stuck, flooded with abandoned sequence starts or calling itself, every request to another
model of the same stage is answered through the router, none refused or late past its deadline (the
latencies themselves are the benchmark's to report, not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_another_model_of_the_stage_is_answered_whatever_one_model_suffers(tmp_path: Path) -> None:
    out = tmp_path / "isolation.json"
    finished = subprocess.run(
        [sys.executable, "-m", "bench.isolation", "--duration", "1", "--concurrency", "2", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = {r["case"]: r for r in json.loads(out.read_text())}
    assert list(results) == [
        "alone",
        "slow model, 100 in flight",
        "stuck model, 200 held",
        "1,000 abandoned sequence starts",
        "self-calling model, 16 callers",
    ]
    for case, result in results.items():
        assert result["answered"] > 0 and result["errors"] == {}, (case, result)
    # Each abuse really happened: the abused model's requests were held or refused, not served at once.
    assert results["stuck model, 200 held"]["abuse"].get("DEADLINE_EXCEEDED", 0) >= 200
    assert results["slow model, 100 in flight"]["abuse"].get("DEADLINE_EXCEEDED", 0) > 0
    assert "| alone |" in finished.stdout and "p99 / alone" in finished.stdout

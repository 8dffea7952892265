"""`python -m bench.bls_call` runs as docs/serving/bls.md says: the pipeline on the repository it writes,
every form answered right (the benchmark checks each answer), and the four per-process figures reported. A
benchmark that no longer starts is found here, not when someone next needs its figures (the timings
themselves are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_the_bls_call_benchmark_measures_every_form_and_reports_each_figure(tmp_path: Path) -> None:
    out = tmp_path / "figures.jsonl"
    finished = subprocess.run(
        [
            *(sys.executable, "-m", "bench.bls_call", "--duration", "0.5", "--rounds", "1"),
            *("--calls", "2", "--elements", "3", "--concurrency", "2", "--out", str(out)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    forms = {r["form"]: r for r in results}
    assert set(forms) == {"chain_1", "chain_2", "bls_1", "bls_2", "fan@1", "fan@3", "bls_fan@1", "bls_fan@3"}
    for result in results:
        assert result["server"] == "pipeline" and result["requests_per_s"] > 0, result
        processes = {"router", "preprocess", "model", "postprocess", "all"}
        # The compiled front is one more process where it is built (`make test` builds it).
        assert set(result["cpu_us_per_request"]) in (processes, processes | {"front"})
    # The BLS forms ran their calls in the preprocess service; the ensembles never touched it.
    assert forms["bls_2"]["cpu_us_per_request"]["preprocess"] > 0
    for figure in ("ensemble step", "BLS call", "fan-out element", "BLS fan-out call"):
        assert f"\n{figure} " in finished.stdout, figure
    assert "pipeline: BLS call / ensemble step (all processes):" in finished.stdout

"""`python -m bench.torchserve` runs as docs/serving/torchserve.md says: the benchmark's archive served by
`pipeline run --model-store`, as one stage and as three (`--split`), answered right and alike (the benchmark
checks the answers before the load), loaded at
each level by its load generator, and every figure reported: requests/s, p50, p99, errors, CPU per request,
the machine's other load and the mean batch, then the table and the targets. A benchmark that no longer
starts is found here, not when someone next needs its figures (the timings themselves are not checked).
TorchServe itself is not installed here: the benchmark measures the pipeline alone without it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
FIGURES = ("requests_per_s", "p50_ms", "p99_ms", "cpu_us_per_request", "client_cores", "foreign_cores")


def test_the_torchserve_benchmark_reports_each_figure_at_each_level(tmp_path: Path) -> None:
    out = tmp_path / "figures.jsonl"
    finished = subprocess.run(
        [
            *(sys.executable, "-m", "bench.torchserve", "--duration", "0.5", "--warmup", "0.2"),
            *("--concurrency", "1,4", "--split", "--out", str(out)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert 'every server answers b\'{\\n  "label": ' in finished.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["server"], row["concurrency"]) for row in rows] == [
        ("pipeline", 1),
        ("pipeline split", 1),
        ("pipeline", 4),
        ("pipeline split", 4),
    ]
    for row in rows:
        assert row["errors"] == 0 and row["completed"] > 0, row
        for figure in FIGURES:
            assert isinstance(row[figure], float) and row[figure] >= 0, (figure, row)
        assert row["requests_per_s"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0, row
        # A lone client's request is a batch of one; each batch ran at least one request.
        assert row["mean_batch"] >= 1.0, row
    assert rows[0]["mean_batch"] == rows[1]["mean_batch"] == 1.0
    assert "| 1 | " in finished.stdout and "| 4 | " in finished.stdout
    assert "pipeline: mean batch at 4 clients: " in finished.stdout
    assert "pipeline split: mean batch at 4 clients: " in finished.stdout
    assert "pipeline / TorchServe: not measured (no --torchserve-home)" in finished.stdout

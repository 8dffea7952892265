"""The pagenumber example as a user runs it: `pipeline run` on a repository of the example's models and the
digits CNN (its stages find the router's port where the launcher has it written, for the BLS model's
calls), and `pipeline infer --model pagenumber page.png` printing the page's number, both ways."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.pagenumber import repository
from bench.running import REPO, Pipeline
from examples.pagenumber import held_out_pages
from tests.integration.test_pagenumber import in_process

pytestmark = pytest.mark.e2e


def test_pipeline_infer_prints_the_number_of_a_page_both_ways(tmp_path: Path) -> None:
    root = repository(tmp_path / "repository")
    [(page, _)] = held_out_pages(1, 6, seed=5)
    [number] = in_process(root, [page])
    path = tmp_path / "page.png"
    path.write_bytes(page)
    pipeline = Pipeline(root, tmp_path / "pipeline.log")
    try:
        for model in ("pagenumber", "pagenumber_bls"):
            command = [
                sys.executable,
                "-m",
                "pipeline",
                "infer",
                "--url",
                pipeline.router,
                "-m",
                model,
                str(path),
            ]
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            assert f"NUMBER={number}" in done.stdout, done.stdout
    finally:
        pipeline.stop()

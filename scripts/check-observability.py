"""Check Prometheus and the Grafana dashboard against a running pipeline (CI runs it during a bench run).

Two checks, through Prometheus' HTTP API, until both pass or the time is up:
- every scrape target is up, and each job has the number of targets expected (one per replica);
- every query of every panel of the dashboard returns at least one finite value.

    python scripts/check-observability.py --prometheus http://127.0.0.1:9090 \
        --dashboard observability/grafana/dashboards/pipeline.json --targets router=1 preprocess=2

Standard library only. Exit status 0 when both pass; 1 with what failed otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path


def api(prometheus: str, path: str, **params: str) -> dict:
    """GET one Prometheus API endpoint; returns its `data`."""
    url = f"{prometheus.rstrip('/')}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.load(reply)
    if body.get("status") != "success":
        raise RuntimeError(f"{path}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, rows' panels included."""
    queries = []
    stack = list(json.loads(path.read_text())["panels"])
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            if target.get("expr"):
                queries.append((panel["title"], target["expr"]))
    return queries


def target_problems(prometheus: str, expected: dict[str, int]) -> list[str]:
    """What is wrong with the scrape targets, or nothing."""
    targets = api(prometheus, "targets", state="active")["activeTargets"]
    problems = []
    up: dict[str, int] = {}
    for target in targets:
        job = target["labels"]["job"]
        if target["health"] == "up":
            up[job] = up.get(job, 0) + 1
        else:
            problems.append(
                f"target {job} {target['scrapeUrl']} is {target['health']}: {target['lastError']}"
            )
    for job, count in expected.items():
        if up.get(job, 0) != count:
            problems.append(f"job {job}: {up.get(job, 0)} targets up, expected {count}")
    return problems


def query_problems(prometheus: str, queries: list[tuple[str, str]]) -> list[str]:
    """The panels' queries that return no finite value, or nothing."""
    problems = []
    for title, expr in queries:
        result = api(prometheus, "query", query=expr)["result"]
        values = [float(series["value"][1]) for series in result]
        if not any(math.isfinite(v) for v in values):
            problems.append(f"panel {title!r}: no data from {expr} ({len(values)} series)")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--dashboard", type=Path, required=True)
    parser.add_argument("--targets", nargs="+", default=[], help="JOB=COUNT: targets up expected per job")
    parser.add_argument("--timeout", type=float, default=90, help="seconds to wait for both checks to pass")
    args = parser.parse_args()
    expected = {job: int(count) for job, count in (pair.split("=", 1) for pair in args.targets)}
    queries = dashboard_queries(args.dashboard)
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            problems = target_problems(args.prometheus, expected) or query_problems(args.prometheus, queries)
        except (OSError, urllib.error.URLError, RuntimeError) as err:
            problems = [f"Prometheus at {args.prometheus}: {err}"]
        if not problems:
            jobs = ", ".join(f"{job} {count}" for job, count in sorted(expected.items()))
            print(
                f"check-observability: every target up ({jobs}); all {len(queries)} dashboard queries return data"
            )
            return 0
        if time.monotonic() > deadline:
            print(f"check-observability: FAILED after {args.timeout:.0f}s:", file=sys.stderr)
            for problem in problems:
                print(f"  {problem}", file=sys.stderr)
            return 1
        time.sleep(2)  # Prometheus scrapes every 5 s and rates need two samples


if __name__ == "__main__":
    sys.exit(main())

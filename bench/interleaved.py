"""The refcnn pipeline beside Triton 2.51 and TorchServe on a shared machine: all three up at once, each level
of load run on one after the other, `--rounds` times, so that every server meets the machine's other load
alike (`bench.front` runs one server's levels after another's, and on a busy machine a server's figures then
follow whatever else ran in its minutes).

    python -m bench.interleaved RESULTS_DIR --peers DIR [--rounds 2] [--warmup S] [--duration S] [--quiet-wait S]

The pipeline goes through the compiled front (`--front compiled`) with batching ON; Triton serves the peers'
ensemble without queue delays (its better configuration at every level in every run so far), TorchServe as the
peers run it (where its environment is set up). Each row is the peers' load generator's, with the CPU each
request cost every process of each server and what the rest of the machine used meanwhile; a bare grpc.aio
server's CPU per call is measured first. The ratios are each round's, paired.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import grpc_floor, peers
from bench.compare import ensemble_variant, peers_level
from bench.running import Pipeline, wait_ready

LEVELS = peers.LEVELS
SYSTEMS = ("pipeline", "triton", "torchserve")


def run(
    work: Path, out: Path, peer_dir: Path, rounds: int, warmup: float, duration: float, quiet: float
) -> dict[str, Any]:
    """Every system's row at every level in every round, by system: lists in the order they ran (`quiet`: how
    long each level waits for a quiet machine first)."""
    rows: dict[str, list[dict[str, Any]]] = {system: [] for system in SYSTEMS}
    folder = ensemble_variant(work / "repository", True)
    with contextlib.ExitStack() as stack:
        running = Pipeline(folder, out / "pipeline.log", env={"PIPELINE_FRONT": "compiled"})
        stack.callback(running.stop)
        asyncio.run(wait_ready(running.router, "refcnn"))
        triton = stack.enter_context(peers.triton_serving(peer_dir, 0))
        torchserve = None
        if (peer_dir / "torchserve" / "venv").exists():
            torchserve = stack.enter_context(peers.torchserve_serving(peer_dir))
        for round_ in range(rounds):
            for c in LEVELS:
                base = out / f"loadgen-r{round_}-c{c}"
                print(f"\n== round {round_ + 1}, {c} in flight", flush=True)
                label = "pipeline compiled door"
                at = base.with_suffix(".pipeline.json")
                level = (warmup, duration, c)
                rows["pipeline"].append(peers_level(running, peer_dir, at, label, *level, quiet))
                label = "triton delay=0us"
                at = base.with_suffix(".triton.json")
                rows["triton"].append(
                    peers.oip_level(peer_dir, peers.TRITON_URL, label, at, *level, triton, quiet)
                )
                if torchserve is not None:
                    at = base.with_suffix(".torchserve.json")
                    rows["torchserve"].append(peers.torchserve_level(peer_dir, torchserve, at, *level, quiet))
    return rows


def _level(rows: list[dict[str, Any]], c: int) -> list[dict[str, Any]]:
    return [row for row in rows if row["concurrency"] == c]


def _cpu(row: dict[str, Any], *names: str) -> float:
    found = row.get("cpu_us_per_request") or {}
    values = [found.get(name) for name in names]
    return math.nan if any(v is None for v in values) else sum(values)


def _ratios(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], key: str) -> list[float]:
    return [a[key] / b[key] if b[key] else math.nan for a, b in zip(ours, theirs, strict=False)]


def _each(values: list[float], digits: int = 2) -> str:
    return ", ".join(f"{v:,.{digits}f}" for v in values)


def summarise(results: dict[str, Any]) -> str:
    """The side-by-side table (each round's figure) and the ratios the targets name."""
    rows = results["rows"]
    head = " | ".join(f"c={c} infer/s | p50 ms" for c in LEVELS)
    lines = [
        f"| system (each round) | {head} | other load, cores (each level as run) |",
        "|---|" + "---:|" * (2 * len(LEVELS) + 1),
    ]
    names = {
        "pipeline": "pipeline, compiled door",
        "triton": "Triton 2.51, no queue delay",
        "torchserve": "TorchServe",
    }
    for system in SYSTEMS:
        if not rows[system]:
            continue
        cells = []
        for c in LEVELS:
            level = _level(rows[system], c)
            cells += [_each([r["throughput"] for r in level], 0), _each([r["p50_ms"] for r in level])]
        others = _each([r["foreign_cpu_cores"] for r in rows[system]])
        lines.append(f"| {names[system]} | " + " | ".join(cells) + f" | {others} |")
    ours, triton, torchserve = (rows[s] for s in SYSTEMS)
    aio = results["floor"]["server_us"]
    door = [_cpu(r, "front", "router") for r in _level(ours, 32)]
    whole = [_cpu(r, "all") for r in _level(ours, 32)]
    triton_whole = [_cpu(r, "all") for r in _level(triton, 32)]
    lines += [
        "",
        f"- pipeline / Triton, c=8: **{_each(_ratios(_level(ours, 8), _level(triton, 8), 'throughput'))}** "
        f"(target ≥ 0.9); c=32: **{_each(_ratios(_level(ours, 32), _level(triton, 32), 'throughput'))}** (≥ 1.0)",
        f"- pipeline / TorchServe, c=32: "
        f"**{_each(_ratios(_level(ours, 32), _level(torchserve, 32), 'throughput'))}** (≥ 1.2)",
        f"- p50 at c=1: pipeline {_each([r['p50_ms'] for r in _level(ours, 1)])} ms, Triton "
        f"{_each([r['p50_ms'] for r in _level(triton, 1)])} ms (no higher)",
        f"- CPU per request at c=32, front and router (µs): {_each(door, 0)}, against a bare grpc.aio server's "
        f"{aio:.0f} per call: **{_each([d / aio for d in door])}** (≤ 0.5)",
        f"- CPU per request at c=32, the whole pipeline (µs): {_each(whole, 0)}; Triton's whole pipeline "
        f"{_each(triton_whole, 0)}: **{_each([a / b for a, b in zip(whole, triton_whole, strict=False)])}** "
        f"(≤ 1.0); TorchServe {_each([_cpu(r, 'all') for r in _level(torchserve, 32)], 0)}",
    ]
    processes = ("front", "router", "preprocess", "model", "postprocess")
    mean = {p: statistics.mean(_cpu(r, p) for r in _level(ours, 32)) for p in processes}
    lines.append(
        "- the pipeline's CPU per request at c=32 by process (µs, the rounds' mean): "
        + ", ".join(f"{p} {v:.0f}" for p, v in mean.items())
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.interleaved", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="folder for results.json, summary.md and the logs")
    parser.add_argument("--peers", type=Path, required=True, help="shared/peers laid out and set up there")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every level on every system")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each measured level")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per level")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="seconds each level may wait for the machine's other load to fall under 0.15 of a core (default "
        "none: each server's CPU is read around the load generator's run, which would count its idle CPU over "
        "the wait, and the servers take turns anyway)",
    )
    args = parser.parse_args(argv)
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    floor = grpc_floor.measure("aio", 32)
    print(f"a bare grpc.aio server: {floor.server_us:.0f} µs of CPU per call at 32 in flight", flush=True)
    results: dict[str, Any] = {"floor": {"server_us": floor.server_us, "calls_per_s": floor.calls_per_s}}
    with tempfile.TemporaryDirectory(prefix="interleaved-bench-") as work:
        results["rows"] = run(
            Path(work), out, args.peers, args.rounds, args.warmup, args.duration, args.quiet_wait
        )
    results["seconds"] = time.monotonic() - started
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    summary = summarise(results)
    (out / "summary.md").write_text(summary + "\n")
    print("\n" + summary + f"\n\n({results['seconds']:.0f} s; written to {out})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

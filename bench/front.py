"""The router's two doors side by side, in one run: the refcnn pipeline (batching ON) served through the compiled
front (`--front compiled`, pipeline-front) and through the router's own Python gRPC server (`--front python`),
then Triton 2.51 (its two configurations) and, where its environment is set up, TorchServe, all under the
peers' load generator at concurrency 1, 8 and 32, with the CPU each request cost every process of each server (the
pipeline's by process, Triton's and TorchServe's all together) and what the rest of the machine used meanwhile;
and a bare grpc.aio server's CPU per call, measured in the same run, against which the front and router's CPU
per request is read.

    python -m bench.front RESULTS_DIR --peers DIR [--warmup S] [--duration S]

The machine is shared and noisy: read the ratios, which come from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import grpc_floor, peers
from bench.compare import _at, _ratio, ensemble_variant, peers_levels
from bench.running import Pipeline, wait_ready

LEVELS = peers.LEVELS
DOORS = ("compiled", "python")


def door(name: str, work: Path, out: Path, peer_dir: Path, warmup: float, duration: float) -> list[dict]:
    """The pipeline with batching ON served through `name`'s door, under the peers' load generator."""
    print(f"\n== the pipeline through the {name} door", flush=True)
    folder = ensemble_variant(work / f"repository-{name}", True)
    running = Pipeline(folder, out / f"pipeline-{name}.log", env={"PIPELINE_FRONT": name})
    try:
        asyncio.run(wait_ready(running.router, "refcnn"))
        return peers_levels(
            running, peer_dir, out / f"loadgen-{name}", f"pipeline {name} door", warmup, duration
        )
    finally:
        running.stop()


def summarise(results: dict[str, Any]) -> str:
    """The side-by-side table, and the ratios the targets name."""
    triton = {int(delay): rows for delay, rows in results.get("triton", {}).items()}
    systems: dict[str, Any] = {f"pipeline, {name} door": results["doors"][name] for name in DOORS}
    systems["TorchServe"] = results.get("torchserve")
    for delay, rows in sorted(triton.items(), reverse=True):
        systems[f"Triton 2.51, {delay} µs queue delay"] = rows
    head = " | ".join(f"c={c} infer/s | p50 ms" for c in LEVELS)
    lines = [f"| system | {head} | other load, cores |", "|---|" + "---:|" * (2 * len(LEVELS) + 1)]
    for name, rows in systems.items():
        if not rows:
            continue
        cells = [
            f"{_at(rows, c, k):,.{0 if k == 'throughput' else 2}f}"
            for c in LEVELS
            for k in ("throughput", "p50_ms")
        ]
        # What the rest of the machine used while each level ran (the load generator's reading).
        others = " / ".join(f"{_at(rows, c, 'foreign_cpu_cores'):.2f}" for c in LEVELS)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {others} |")

    def best(c: int) -> float:
        return max((_at(rows, c, "throughput") for rows in triton.values()), default=math.nan)

    aio = results["floor"]["server_us"]
    torchserve = results.get("torchserve")
    # Triton's better configuration at c=32, and what its whole pipeline cost per request there.
    triton32 = max(triton.values(), key=lambda rows: _at(rows, 32, "throughput"), default=None)
    triton_cpu = _cpu(triton32)
    lowest_p50 = min((_at(r, 1, "p50_ms") for r in triton.values()), default=math.nan)
    lines.append("")
    for name in DOORS:
        rows = results["doors"][name]
        cpu = next((r["cpu_us_per_request"] for r in rows if r["concurrency"] == 32), {})
        door_cpu = cpu.get("router", math.nan) + cpu.get("front", 0.0)
        lines += [
            f"- {name} door / Triton's better configuration: c=8 **{_ratio(_at(rows, 8, 'throughput'), best(8))}** "
            f"(target ≥ 0.9), c=32 **{_ratio(_at(rows, 32, 'throughput'), best(32))}** (≥ 1.0); / TorchServe at "
            f"c=32 **{_ratio(_at(rows, 32, 'throughput'), _at(torchserve, 32, 'throughput'))}** (≥ 1.2); p50 at "
            f"c=1 {_at(rows, 1, 'p50_ms'):.2f} ms (Triton's lowest {lowest_p50:.2f}: no higher)",
            f"  CPU per request at c=32 (µs): front {cpu.get('front', 0):.0f}, router {cpu.get('router', math.nan):.0f}, "
            f"preprocess {cpu.get('preprocess', math.nan):.0f}, model {cpu.get('model', math.nan):.0f}, postprocess "
            f"{cpu.get('postprocess', math.nan):.0f}, all **{cpu.get('all', math.nan):.0f}** (Triton's whole "
            f"pipeline {triton_cpu:.0f}: **{_ratio(cpu.get('all', math.nan), triton_cpu)}**, target ≤ 1.0); front "
            f"and router / a bare grpc.aio server's {aio:.0f} µs per call: **{_ratio(door_cpu, aio)}** (≤ 0.5)",
        ]
    lines.append(
        f"- CPU per request at c=32, whole server (µs): Triton 2.51 at its better configuration {triton_cpu:.0f}, "
        f"TorchServe {_cpu(torchserve):.0f}"
    )
    return "\n".join(lines)


def _cpu(rows: list[dict] | None) -> float:
    """The whole server's CPU per request at c=32 (µs), where it was measured."""
    row = next((r for r in rows or [] if r["concurrency"] == 32), {})
    value = row.get("cpu_us_per_request", {}).get("all")
    return math.nan if value is None else value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.front", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="folder for results.json, summary.md and the logs")
    parser.add_argument("--peers", type=Path, required=True, help="shared/peers laid out and set up there")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each measured level")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per level")
    parser.add_argument("--skip-triton", action="store_true", help="measure the doors and the floor only")
    args = parser.parse_args(argv)
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    floor = grpc_floor.measure("aio", 32)
    print(f"a bare grpc.aio server: {floor.server_us:.0f} µs of CPU per call at 32 in flight", flush=True)
    results: dict[str, Any] = {"floor": {"server_us": floor.server_us, "calls_per_s": floor.calls_per_s}}
    with tempfile.TemporaryDirectory(prefix="front-bench-") as work:
        results["doors"] = {
            name: door(name, Path(work), out, args.peers, args.warmup, args.duration) for name in DOORS
        }
    if not args.skip_triton:
        try:
            results["triton"] = peers.triton(args.peers, out / "peers-triton", args.warmup, args.duration)
        except (OSError, subprocess.SubprocessError) as err:
            print(f"Triton not measured: {err}", flush=True)
        if (args.peers / "torchserve" / "venv").exists():
            results["torchserve"] = peers.torchserve(
                args.peers, out / "peers-torchserve", args.warmup, args.duration
            )
    results["seconds"] = time.monotonic() - started
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    summary = summarise(results)
    (out / "summary.md").write_text(summary + "\n")
    print("\n" + summary + f"\n\n({results['seconds']:.0f} s; written to {out})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

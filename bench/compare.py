"""Compare the refcnn workload served on this machine, in one run, and write the figures.

    bench/run.sh RESULTS_DIR [--duration S] [--warmup S] [--peers DIR]

- the floor: what a bare Python gRPC server spends on a call, in each server flavour (`bench.grpc_floor`);
- the ceiling: pre + model + post in plain PyTorch, in this process, on batches of 1, 8 and 32, with the
  same thread count as the model service (1);
- the pipeline started by `pipeline run`, with the router's dynamic batching OFF and ON, loaded by
  `pipeline bench` at concurrency 1, 8 and 32 (the OFF variant also measures the router's own hop);
- with `--peers DIR` (shared/peers laid out there by its install.sh and set up by its setup.sh): the
  pipeline (batching ON) under the peers' load generator at 1, 8 and 32 with the CPU each request cost in
  each process and the model step's mean batch, the same with tracing on (every request sampled, OTLP over
  HTTP to a local receiver) against off in two interleaved pairs, then the peers' in-process baseline,
  TorchServe and Triton (its two configurations) under the same load generator, one server after another;
  and the ratios between them (`bench.interleaved` measures the performance targets, every server up at once
  and the levels interleaved).

The machine is shared and noisy: read the ratios, which come from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from bench import grpc_floor, peers
from bench.running import REPO, Pipeline, mean_batch, per_request, statistics, wait_ready
from examples.models.build import build
from pipeline._gen.inference import model_config_pb2 as mc

LEVELS = peers.LEVELS
#: What batching ON means for a model whose committed config sets no dynamic_batching.
DEFAULT_DELAY_US = 2000


def ceiling(levels: tuple[int, ...], seconds: float) -> list[dict[str, Any]]:
    """Plain PyTorch, pre + model + post on batches of each size, one thread: images/s and batch latency."""
    import numpy as np
    import torch

    from examples.models.refcnn import build_refcnn

    torch.set_num_threads(1)
    model = build_refcnn()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    rng = np.random.default_rng(0)
    rows = []
    for batch in levels:
        images = torch.from_numpy(rng.integers(0, 256, size=(batch, 3, 64, 64), dtype=np.uint8))
        latencies = []
        with torch.inference_mode():
            end = time.perf_counter() + seconds
            while (t0 := time.perf_counter()) < end:
                x = images.to(torch.float32).div_(255.0)
                probs = torch.softmax(model((x - mean) / std), dim=1)
                probs.max(dim=1)
                latencies.append(time.perf_counter() - t0)
        lat = np.sort(np.asarray(latencies[1:] or latencies))  # the first call pays one-off set-up
        rows.append(
            {
                "concurrency": batch,
                "throughput_infer_per_s": batch * lat.size / lat.sum(),
                "p50_ms": float(np.percentile(lat, 50) * 1e3),
                "p99_ms": float(np.percentile(lat, 99) * 1e3),
            }
        )
    return rows


#: The example repository's entries that the refcnn ensemble calls.
REFCNN_MODELS = ("refcnn_preprocess", "refcnn_cnn", "refcnn_postprocess")


def ensemble_variant(folder: Path, batching: bool) -> Path:
    """A model repository in `folder` that serves refcnn alone: its ensemble and its models, copied from the
    example repository, each model with its own dynamic batching (ON) or none (OFF)."""
    repository = REPO / "model_repository"
    # A fresh clone has no model file yet: `make run` and `make model` write it, and so does this.
    build(repository, ["refcnn_cnn"], progress=False)
    for model in ("refcnn", *REFCNN_MODELS):
        shutil.copytree(repository / model, folder / model, dirs_exist_ok=True)
    for model in REFCNN_MODELS:
        config = folder / model / "config.pbtxt"
        parsed = text_format.Parse(config.read_text(), mc.ModelConfig())
        if not batching:
            parsed.ClearField("dynamic_batching")
        elif not parsed.HasField("dynamic_batching"):
            parsed.dynamic_batching.max_queue_delay_microseconds = DEFAULT_DELAY_US
        config.write_text(text_format.MessageToString(parsed))
    return folder


def measure(
    url: str,
    model: str,
    levels: tuple[int, ...],
    warmup: float,
    duration: float,
    cpu_metrics: dict[str, str] | None = None,
) -> list[dict]:
    """`pipeline bench` at each concurrency: throughput, p50, p99, errors, the server's per-stage figures and
    the CPU each request cost in each process."""
    from pipeline.tools.bench.options import BenchOptions
    from pipeline.tools.bench.report import format_report
    from pipeline.tools.bench.run import run_bench

    options = BenchOptions(
        url=url,
        model=model,
        concurrency=levels,
        warmup=warmup,
        duration=duration,
        progress=False,
        cpu_metrics=cpu_metrics or {},
    )
    report = asyncio.run(run_bench(options))
    print(format_report(report), flush=True)
    return [
        {
            "concurrency": int(r.level.value),
            "throughput_infer_per_s": r.infer_per_s,
            "p50_ms": r.percentile_ms(50),
            "p99_ms": r.percentile_ms(99),
            "errors": dict(r.errors),
            "stages": r.stages,
            "cpu_us_per_request": r.cpu_us_per_request(),
        }
        for r in report.results
    ]


def peers_level(
    running: Pipeline,
    peer_dir: Path,
    out: Path,
    label: str,
    warmup: float,
    duration: float,
    concurrency: int,
    quiet_wait: float = 30.0,
) -> dict[str, Any]:
    """The peers' load generator on the pipeline at one concurrency, with each process's CPU per request and
    the model step's mean batch over the measured interval."""
    # The pipeline's processes are its own, not the machine's other load, in the load generator's figure.
    pidfile = out.with_suffix(".pid")
    pidfile.write_text(f"{running.process.pid}\n")
    stats_before, cpu_before = statistics(running.router, "refcnn_cnn"), running.cpu()
    oip = ("--model", "refcnn", "--input-name", "IMAGE", "--output-name", "LABEL")
    oip += ("--server-pidfile", str(pidfile))
    row = peers.loadgen(
        peer_dir,
        "v2grpc",
        running.router,
        label,
        out,
        warmup,
        duration,
        concurrency,
        *oip,
        quiet_wait=quiet_wait,
    )
    cpu_after, stats_after = running.cpu(), statistics(running.router, "refcnn_cnn")
    # CPU over warm-up and measurement alike, per request answered in that time.
    answered = row["throughput"] * (warmup + duration)
    row["cpu_us_per_request"] = per_request(cpu_before, cpu_after, answered)
    row["model_mean_batch"] = mean_batch(stats_before, stats_after)
    print(
        f"   cpu µs/request {row['cpu_us_per_request']}; model step mean batch {row['model_mean_batch']}",
        flush=True,
    )
    return row


def peers_levels(
    running: Pipeline, peer_dir: Path, out: Path, label: str, warmup: float, duration: float
) -> list[dict]:
    """`peers_level` at every level."""
    return [
        peers_level(running, peer_dir, out.with_suffix(f".c{c}.json"), label, warmup, duration, c)
        for c in LEVELS
    ]


def run_pipeline_variant(
    name: str,
    batching: bool,
    work: Path,
    out: Path,
    warmup: float,
    duration: float,
    peer_dir: Path | None = None,
) -> dict[str, Any]:
    """Start the pipeline with batching OFF or ON, load it, stop it; the figures or why there are none."""
    print(f"\n== pipeline, batching {name}", flush=True)
    folder = ensemble_variant(work / f"repository-{name.lower()}", batching)
    try:
        running = Pipeline(folder, out / f"pipeline-{name.lower()}.log")
    except RuntimeError as err:
        print(f"skipped: {err}", flush=True)
        return {"error": str(err)}
    try:
        asyncio.run(wait_ready(running.router, "refcnn"))
        levels = measure(running.router, "refcnn", LEVELS, warmup, duration, running.metrics)
        result: dict[str, Any] = {"levels": levels}
        if not batching:
            # The router's own cost: the same stage model called directly and through the router.
            direct = measure(running.stages["model"], "refcnn_cnn", (1,), warmup / 2, duration / 2)
            routed = measure(running.router, "refcnn_cnn", (1,), warmup / 2, duration / 2)
            result["hop"] = {"model": "refcnn_cnn", "direct": direct[0], "through_router": routed[0]}
        if peer_dir is not None:
            print("\n== the pipeline under the peers' load generator (OIP gRPC)", flush=True)
            result["peers_loadgen"] = peers_levels(
                running,
                peer_dir,
                out / f"loadgen-pipeline-{name.lower()}",
                f"pipeline batching {name}",
                warmup,
                duration,
            )
        return result
    finally:
        running.stop()


def tracing_pairs(
    work: Path, out: Path, peer_dir: Path, warmup: float, duration: float
) -> list[dict[str, Any]]:
    """Throughput at concurrency 32 with tracing off and on (every request sampled, OTLP over HTTP to a
    local receiver on the same cores), interleaved: off, on, off, on."""
    folder = ensemble_variant(work / "repository-tracing", True)
    port_file = work / "otlp.port"
    sink = subprocess.Popen(
        [sys.executable, "-m", "bench.otlp_sink", "--port-file", str(port_file)], cwd=REPO
    )
    try:
        while not port_file.exists():
            time.sleep(0.05)
        endpoint = f"http://127.0.0.1:{int(port_file.read_text())}"
        tracing = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_TRACES_SAMPLER": "always_on",
        }
        rows = []
        for i, on in enumerate((False, True, False, True)):
            label = f"pipeline tracing {'on' if on else 'off'}"
            print(f"\n== {label} ({i + 1} of 4)", flush=True)
            running = Pipeline(folder, out / f"pipeline-tracing-{i}.log", env=tracing if on else None)
            try:
                asyncio.run(wait_ready(running.router, "refcnn"))
                cpu_before = running.cpu()
                row = peers.loadgen(
                    peer_dir,
                    "v2grpc",
                    running.router,
                    label,
                    out / f"loadgen-tracing-{i}.json",
                    warmup,
                    duration,
                    32,
                    "--model",
                    "refcnn",
                    "--input-name",
                    "IMAGE",
                    "--output-name",
                    "LABEL",
                )
                row["cpu_us_per_request"] = per_request(
                    cpu_before, running.cpu(), row["throughput"] * (warmup + duration)
                )
                row["tracing"] = on
                rows.append(row)
            finally:
                running.stop()
        return rows
    finally:
        sink.terminate()
        sink.wait()


def floors() -> list[dict[str, Any]]:
    """A bare server's CPU per call at concurrency 32 in each flavour (12 KiB, one refcnn image)."""
    rows = []
    for flavour in grpc_floor.FLAVOURS:
        floor = grpc_floor.measure(flavour, 32)
        print(
            f"{flavour}: {floor.calls_per_s:,.0f} calls/s, server {floor.server_us:.0f} µs, client {floor.client_us:.0f} µs per call",
            flush=True,
        )
        rows.append(
            {
                "flavour": flavour,
                "calls_per_s": floor.calls_per_s,
                "server_us": floor.server_us,
                "client_us": floor.client_us,
            }
        )
    return rows


def _at(rows: list[dict] | None, concurrency: int, key: str) -> float:
    for row in rows or []:
        if row["concurrency"] == concurrency:
            value = row.get(key)
            return math.nan if value is None else value
    return math.nan


def _ratio(a: float, b: float) -> str:
    return "n/a" if not (a > 0 and b > 0) else f"{a / b:.2f}"


def _mean(values: list[float]) -> float:
    good = [v for v in values if v == v]
    return sum(good) / len(good) if good else math.nan


def summarise(results: dict[str, Any]) -> str:
    """The tables and the ratios, as Markdown."""
    head = " | ".join(f"c={c} infer/s | p50 ms | p99 ms" for c in LEVELS)
    lines = ["`pipeline bench`:", "", f"| variant | {head} |", "|---|" + "---:|" * (3 * len(LEVELS))]
    variants = {
        "ceiling (in-process PyTorch)": results["ceiling"],
        "pipeline, batching OFF": results["off"].get("levels"),
        "pipeline, batching ON": results["on"].get("levels"),
    }
    for name, rows in variants.items():
        cells = []
        for c in LEVELS:
            cells += [
                f"{_at(rows, c, 'throughput_infer_per_s'):,.0f}",
                f"{_at(rows, c, 'p50_ms'):.2f}",
                f"{_at(rows, c, 'p99_ms'):.2f}",
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    off, on = variants["pipeline, batching OFF"], variants["pipeline, batching ON"]
    thr = "throughput_infer_per_s"
    lines += ["", f"- batching ON / OFF throughput at c=32: {_ratio(_at(on, 32, thr), _at(off, 32, thr))}"]
    hop = results["off"].get("hop")
    if hop:
        direct, routed = hop["direct"]["p50_ms"], hop["through_router"]["p50_ms"]
        lines.append(
            f"- router hop ({hop['model']} at c=1): direct p50 {direct:.2f} ms, through the router "
            f"{routed:.2f} ms, overhead {routed - direct:.2f} ms"
        )
    floor = {row["flavour"]: row for row in results.get("floor", [])}
    if floor:
        lines += ["", "The floor, a bare server's CPU per call at c=32 (µs, server / client):", ""]
        lines += [f"- {name}: {row['server_us']:.0f} / {row['client_us']:.0f}" for name, row in floor.items()]
    if results.get("peers"):
        lines += ["", *_peer_summary(results, floor)]
    for key in ("off", "on"):
        if "error" in results[key]:
            lines.append(f"- batching {key.upper()} not measured: {results[key]['error'].splitlines()[0]}")
    return "\n".join(lines)


def _peer_summary(results: dict[str, Any], floor: dict[str, dict[str, Any]]) -> list[str]:
    """The side-by-side table under the peers' load generator, and the targets' ratios."""
    found = results["peers"]
    ours = results["on"].get("peers_loadgen")
    triton = {int(delay): rows for delay, rows in found.get("triton", {}).items()}
    systems = {"pipeline (batching ON)": ours, "TorchServe": found.get("torchserve")}
    for delay, rows in sorted(triton.items(), reverse=True):
        systems[f"Triton, {delay} µs queue delay"] = rows
    head = " | ".join(f"c={c} infer/s | p50 ms" for c in LEVELS)
    lines = ["The peers' load generator, one server at a time:", "", f"| system | {head} | p99 ms at 32 |"]
    lines.append("|---|" + "---:|" * (2 * len(LEVELS) + 1))
    for name, rows in systems.items():
        cells = [
            f"{_at(rows, c, k):,.{0 if k == 'throughput' else 2}f}"
            for c in LEVELS
            for k in ("throughput", "p50_ms")
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_at(rows, 32, 'p99_ms'):.2f} |")

    def best(c: int) -> float:
        return max((_at(rows, c, "throughput") for rows in triton.values()), default=math.nan)

    lowest_p50 = min((_at(rows, 1, "p50_ms") for rows in triton.values()), default=math.nan)
    cpu = next((r["cpu_us_per_request"] for r in ours or [] if r["concurrency"] == 32), {})
    aio = floor.get("aio", {}).get("server_us", math.nan)
    baseline = max((row["images_per_s"] for row in found.get("baseline", [])), default=math.nan)
    lines += [
        "",
        f"- pipeline / Triton's better configuration: c=8 **{_ratio(_at(ours, 8, 'throughput'), best(8))}**, "
        f"c=32 **{_ratio(_at(ours, 32, 'throughput'), best(32))}**",
        f"- pipeline / TorchServe at c=32: **{_ratio(_at(ours, 32, 'throughput'), _at(found.get('torchserve'), 32, 'throughput'))}**",
        f"- p50 at c=1: pipeline {_at(ours, 1, 'p50_ms'):.2f} ms, Triton's best {lowest_p50:.2f} ms",
        f"- CPU per request at c=32 (µs): front {cpu.get('front', 0):.0f}, router {cpu.get('router', math.nan):.0f}, "
        f"preprocess {cpu.get('preprocess', math.nan):.0f}, model {cpu.get('model', math.nan):.0f}, postprocess "
        f"{cpu.get('postprocess', math.nan):.0f}, all **{cpu.get('all', math.nan):.0f}**",
        f"- front and router / a bare grpc.aio server's CPU per call: "
        f"**{_ratio(cpu.get('front', 0) + cpu.get('router', math.nan), aio)}**",
        f"- model step mean batch at c=32: **{_at(ours, 32, 'model_mean_batch'):.1f}**",
        f"- the peers' in-process baseline, one thread, best of batch 1/8/32: {baseline:,.0f} images/s",
    ]
    pairs = results.get("tracing") or []
    if pairs:
        off = _mean([row["throughput"] for row in pairs if not row["tracing"]])
        on = _mean([row["throughput"] for row in pairs if row["tracing"]])
        each = ", ".join(f"{'on' if r['tracing'] else 'off'} {r['throughput']:,.0f}" for r in pairs)
        lines.append(f"- tracing on / off at c=32: **{_ratio(on, off)}** ({each} req/s)")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write results.json and summary.md into the results folder."""
    parser = argparse.ArgumentParser(prog="bench/run.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="folder for results.json, summary.md and the logs")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each measured level")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per level")
    parser.add_argument("--peers", type=Path, help="a folder where shared/peers was laid out and set up")
    parser.add_argument(
        "--skip-off", action="store_true", help="do not measure the pipeline with batching off"
    )
    args = parser.parse_args(argv)
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PIPELINE_TORCH_THREADS", "1")  # the ceiling and the model stage: the same count
    started = time.monotonic()
    print("== the floor: a bare gRPC server's CPU per call", flush=True)
    results: dict[str, Any] = {"floor": floors()}
    print("\n== ceiling: pre + model + post in plain PyTorch, 1 thread, batches of 1, 8, 32", flush=True)
    results["ceiling"] = ceiling(LEVELS, max(2.0, args.duration / 2))
    for row in results["ceiling"]:
        print(
            f"batch {row['concurrency']:>3}: {row['throughput_infer_per_s']:,.0f} images/s, p50 {row['p50_ms']:.2f} ms",
            flush=True,
        )
    with tempfile.TemporaryDirectory(prefix="refcnn-bench-") as work:
        results["off"] = (
            {}
            if args.skip_off
            else run_pipeline_variant("OFF", False, Path(work), out, args.warmup, args.duration)
        )
        results["on"] = run_pipeline_variant(
            "ON", True, Path(work), out, args.warmup, args.duration, args.peers
        )
        if args.peers is not None:
            results["tracing"] = tracing_pairs(Path(work), out, args.peers, args.warmup, args.duration)
    if args.peers is not None:
        print("\n== peers: the in-process baseline (one thread), TorchServe, Triton", flush=True)
        results["peers"] = {
            "baseline": peers.baseline(args.peers, out / "peers-baseline.json"),
            "torchserve": peers.torchserve(args.peers, out / "peers-torchserve", args.warmup, args.duration),
            "triton": peers.triton(args.peers, out / "peers-triton", args.warmup, args.duration),
        }
    results["seconds"] = time.monotonic() - started
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    summary = summarise(results)
    (out / "summary.md").write_text(summary + "\n")
    print("\n" + summary + f"\n\n({results['seconds']:.0f} s; written to {out})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

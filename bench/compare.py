"""Compare the refcnn workload served three ways on this machine, in one run, and write the figures.

(a) the ceiling: pre + model + post in plain PyTorch, in this process, on batches of 1, 8 and 32, with the
    same thread count as the model service (1);
(b) the pipeline started by `pipeline run` with the router's dynamic batching OFF;
(c) the same with batching ON (`dynamic_batching` on each of the three stages).

Each pipeline is loaded by `pipeline bench`'s core at concurrency 1, 8 and 32. Variant (b) also measures the
router's hop: `refcnn_cnn` called directly on the model stage against the same model called through the
router, at concurrency 1. The machine is shared and noisy: read the ratios, which come from one run.

    bench/run.sh RESULTS_DIR [--duration S] [--warmup S]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
LEVELS = (1, 8, 32)
#: What batching ON means when the committed ensemble does not say.
DEFAULT_BATCHING = {"max_batch_size": 64, "max_queue_delay_microseconds": 2000, "max_inflight_batches": 1}
_SERVING = re.compile(r"pipeline: serving .* on (\S+) \(gRPC")
_STAGE = re.compile(r"(\w+) (\S+:\d+) \(pid \d+\)")
_METRICS = re.compile(r"pipeline: Prometheus metrics: (.*)")
_METRIC_URL = re.compile(r"([\w-]+) (http://\S+/metrics)")


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


def ensemble_variant(folder: Path, batching: bool) -> Path:
    """Write refcnn.yaml with dynamic batching on every stage (ON) or on none (OFF) into `folder`."""
    source = yaml.safe_load((REPO / "ensembles" / "refcnn.yaml").read_text())
    variant = copy.deepcopy(source)
    for stage in variant["stages"].values():
        settings = stage.pop("dynamic_batching", None)
        if batching:
            stage["dynamic_batching"] = settings or dict(DEFAULT_BATCHING)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "refcnn.yaml").write_text(yaml.safe_dump(variant, sort_keys=False))
    return folder


class Pipeline:
    """`pipeline run` on ports the OS picks, its output in a log file; the router's and stages' addresses."""

    def __init__(self, ensembles: Path, log: Path, timeout: float = 240.0) -> None:
        self.log = log
        command = [sys.executable, "-m", "pipeline", "run", "--ensembles", str(ensembles), "--port", "0"]
        command += [
            "--preprocess-port",
            "0",
            "--model-port",
            "0",
            "--postprocess-port",
            "0",
            "--http-port",
            "0",
            "--metrics-port",
            "0",
        ]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            text = log.read_text(errors="replace")
            found = _SERVING.search(text)
            if found:
                self.router = found.group(1)
                line = text[found.start() :].splitlines()[0]
                self.stages = dict(_STAGE.findall(line.split("stages:", 1)[1]))
                # Every process's Prometheus endpoint, for the CPU each request costs in it.
                while (metrics := _METRICS.search(log.read_text(errors="replace"))) is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError("`pipeline run` printed no metrics addresses")
                    time.sleep(0.1)
                self.metrics = dict(_METRIC_URL.findall(metrics.group(1)))
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(text.strip().splitlines()[-5:])
                raise RuntimeError(f"`pipeline run` did not start (see {log.name}):\n{tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # the launcher drains the router, then the stages
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


async def wait_ready(url: str, model: str, timeout: float = 180.0) -> None:
    """Wait until `model` is ready at `url` (stages load their models one after another)."""
    import grpc

    from pipeline._gen.inference import grpc_service_pb2 as pb
    from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while not (await stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=5)).ready:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{model} not ready at {url} within {timeout:.0f}s")
            await asyncio.sleep(0.2)


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


# --------------------------------------------------------------------------------------------------------
# The peers (shared/peers laid out and set up in a folder: its install.sh and setup.sh), side by side


def peer_loadgen(
    peers: Path, mode: str, url: str, label: str, out: Path, warmup: float, duration: float, *extra: str
) -> list[dict[str, Any]]:
    """The peers' own closed-loop load generator against `url` at concurrency 32 (rows of concurrency,
    throughput, p50_ms, p99_ms, errors)."""
    command = [str(peers / "loadgen" / "venv" / "bin" / "python"), str(peers / "loadgen" / "loadgen.py")]
    command += ["--mode", mode, "--url", url, "--concurrency", "32", "--label", label, "--json-out", str(out)]
    command += ["--warmup", str(warmup), "--duration", str(duration), "--quiet-wait", "30", *extra]
    subprocess.run(command, check=True, timeout=warmup + duration + 120)
    return json.loads(out.read_text())


def peer_baseline(peers: Path, out: Path) -> list[dict[str, Any]]:
    """The peers' in-process baseline with one torch thread: images/s at batches of 1, 8 and 32."""
    python = peers / "baseline" / "venv" / "bin" / "python"
    subprocess.run(
        [str(python), str(peers / "baseline" / "bench.py"), "1", str(out)], check=True, timeout=300
    )
    return json.loads(out.read_text())


def peer_torchserve(peers: Path, out: Path, warmup: float, duration: float) -> list[dict[str, Any]]:
    """TorchServe as the peers run it (batch 32, 5 ms, one worker, one torch thread), loaded over HTTP."""
    folder = peers / "torchserve"
    (folder / "model_store").mkdir(exist_ok=True)
    if not (folder / "model_store" / "refcnn.mar").exists():
        archiver = folder / "venv" / "bin" / "torch-model-archiver"
        extra = str(peers / "common" / "refmodel.py")
        archive = [
            "--model-name",
            "refcnn",
            "--version",
            "1.0",
            "--handler",
            "handler.py",
            "--extra-files",
            extra,
        ]
        subprocess.run(
            [str(archiver), *archive, "--export-path", "model_store", "--force"], cwd=folder, check=True
        )
    env = {**os.environ, "REF_TORCH_THREADS": "1", "SERVER_TIMEOUT": "900"}
    subprocess.run(["bash", "serve.sh"], cwd=folder, env=env, check=True, timeout=180)
    try:
        return peer_loadgen(
            peers,
            "http",
            "http://127.0.0.1:8085/predictions/refcnn",
            "torchserve http",
            out,
            warmup,
            duration,
            "--server-pidfile",
            str(folder / "server.pid"),
        )
    finally:
        subprocess.run(
            ["bash", str(peers / "common" / "stop_group.sh"), str(folder / "server.pid")], check=False
        )


def run_pipeline_variant(
    name: str,
    batching: bool,
    work: Path,
    out: Path,
    warmup: float,
    duration: float,
    peers: Path | None = None,
) -> dict[str, Any]:
    """Start the pipeline with batching OFF or ON, load it, stop it; the figures or why there are none."""
    print(f"\n== pipeline, batching {name}", flush=True)
    folder = ensemble_variant(work / f"ensembles-{name.lower()}", batching)
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
        if peers is not None:
            print("\n== the pipeline under the peers' load generator (OIP gRPC, concurrency 32)", flush=True)
            result["peers_loadgen"] = peer_loadgen(
                peers,
                "v2grpc",
                running.router,
                f"pipeline batching {name}",
                out / f"loadgen-pipeline-{name.lower()}.json",
                warmup,
                duration,
                "--model",
                "refcnn",
                "--input-name",
                "IMAGE",
                "--output-name",
                "LABEL",
            )
        return result
    finally:
        running.stop()


def _at(rows: list[dict] | None, concurrency: int, key: str) -> float:
    for row in rows or []:
        if row["concurrency"] == concurrency:
            return row[key]
    return math.nan


def _ratio(a: float, b: float) -> str:
    return "n/a" if not (a > 0 and b > 0) else f"{a / b:.2f}"


def summarise(results: dict[str, Any]) -> str:
    """The table and the ratios, as Markdown."""
    variants = {
        "ceiling (in-process PyTorch)": results["ceiling"],
        "pipeline, batching OFF": results["off"].get("levels"),
        "pipeline, batching ON": results["on"].get("levels"),
    }
    head = " | ".join(f"c={c} infer/s | p50 ms | p99 ms" for c in LEVELS)
    lines = [f"| variant | {head} |", "|---|" + "---:|" * (3 * len(LEVELS))]
    for name, rows in variants.items():
        cells = []
        for c in LEVELS:
            cells += [
                f"{_at(rows, c, 'throughput_infer_per_s'):,.0f}",
                f"{_at(rows, c, 'p50_ms'):.2f}",
                f"{_at(rows, c, 'p99_ms'):.2f}",
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    off, on, ceil = variants["pipeline, batching OFF"], variants["pipeline, batching ON"], results["ceiling"]
    thr = "throughput_infer_per_s"
    lines += [
        "",
        f"- batching ON / OFF throughput at c=32: {_ratio(_at(on, 32, thr), _at(off, 32, thr))}",
        f"- pipeline ON / ceiling throughput at c=32: {_ratio(_at(on, 32, thr), _at(ceil, 32, thr))}",
        f"- pipeline OFF / ceiling throughput at c=32: {_ratio(_at(off, 32, thr), _at(ceil, 32, thr))}",
        f"- p50 at c=1: ceiling {_at(ceil, 1, 'p50_ms'):.2f} ms, OFF {_at(off, 1, 'p50_ms'):.2f} ms, "
        f"ON {_at(on, 1, 'p50_ms'):.2f} ms",
    ]
    peers = results.get("peers")
    if peers:
        ours = _at(results["on"].get("peers_loadgen"), 32, "throughput")
        torchserve = _at(peers.get("torchserve"), 32, "throughput")
        baseline = max((row["images_per_s"] for row in peers.get("baseline", [])), default=math.nan)
        lines += [
            f"- the peers' load generator at c=32: pipeline (batching ON) {ours:,.0f} req/s, TorchServe "
            f"{torchserve:,.0f} req/s: **{_ratio(ours, torchserve)}×** TorchServe",
            f"- the peers' in-process baseline, one thread, best of batch 1/8/32: {baseline:,.0f} images/s; the "
            f"pipeline reaches **{_ratio(ours, baseline)}** of it",
        ]
    hop = results["off"].get("hop")
    if hop:
        direct, routed = hop["direct"]["p50_ms"], hop["through_router"]["p50_ms"]
        lines.append(
            f"- router hop ({hop['model']} at c=1): direct p50 {direct:.2f} ms, through the router "
            f"{routed:.2f} ms, overhead {routed - direct:.2f} ms"
        )
    for key in ("off", "on"):
        if "error" in results[key]:
            lines.append(f"- batching {key.upper()} not measured: {results[key]['error'].splitlines()[0]}")
    return "\n".join(lines)


def _levels(variant: Any) -> list[dict[str, Any]]:
    return variant if isinstance(variant, list) else variant["levels"]


def write_comparison_plot(results: dict[str, Any], path: Path) -> None:
    """Throughput and p99 latency against concurrency for the three variants, as a PNG (matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing (pip install 'pipeline-serving[bench]'): no plot", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {
        "ceiling": "in-process PyTorch (ceiling)",
        "off": "pipeline, batching off",
        "on": "pipeline, batching on",
    }
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    try:
        for key, label in names.items():
            rows = _levels(results[key])
            x = [row["concurrency"] for row in rows]
            left.plot(x, [row["throughput_infer_per_s"] for row in rows], marker="o", label=label)
            right.plot(x, [row["p99_ms"] for row in rows], marker="o", label=label)
        left.set(xlabel="concurrency (the ceiling: batch size)", ylabel="images/s", title="throughput")
        right.set(xlabel="concurrency (the ceiling: batch size)", ylabel="ms", title="p99 latency")
        for axis in (left, right):
            axis.set_xscale("log", base=2)
            axis.set_xticks(list(LEVELS), [str(v) for v in LEVELS])
            axis.grid(True, alpha=0.3)
            axis.set_ylim(bottom=0)
        left.legend()
        fig.suptitle("refcnn on this machine, one run")
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write results.json, summary.md and refcnn.png into the results folder."""
    parser = argparse.ArgumentParser(prog="bench/run.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="folder for results.json, summary.md and the logs")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each measured level")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per level")
    parser.add_argument(
        "--peers",
        type=Path,
        help="a folder where shared/peers was laid out and set up (its install.sh, then setup.sh): also load "
        "the pipeline with the peers' load generator, and run TorchServe and the in-process baseline beside it",
    )
    args = parser.parse_args(argv)
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PIPELINE_TORCH_THREADS", "1")  # the ceiling and the model stage: the same count
    started = time.monotonic()
    print("== ceiling: pre + model + post in plain PyTorch, 1 thread, batches of 1, 8, 32", flush=True)
    results: dict[str, Any] = {"ceiling": ceiling(LEVELS, max(2.0, args.duration / 2))}
    for row in results["ceiling"]:
        print(
            f"batch {row['concurrency']:>3}: {row['throughput_infer_per_s']:,.0f} images/s, "
            f"p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms",
            flush=True,
        )
    with tempfile.TemporaryDirectory(prefix="refcnn-bench-") as work:
        results["off"] = run_pipeline_variant("OFF", False, Path(work), out, args.warmup, args.duration)
        results["on"] = run_pipeline_variant(
            "ON", True, Path(work), out, args.warmup, args.duration, args.peers
        )
    if args.peers is not None:
        print("\n== peers: the in-process baseline (one thread), then TorchServe", flush=True)
        results["peers"] = {
            "baseline": peer_baseline(args.peers, out / "peers-baseline.json"),
            "torchserve": peer_torchserve(
                args.peers, out / "peers-torchserve.json", args.warmup, args.duration
            ),
        }
    results["seconds"] = time.monotonic() - started
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    summary = summarise(results)
    (out / "summary.md").write_text(summary + "\n")
    write_comparison_plot(results, out / "refcnn.png")
    print("\n" + summary + f"\n\n({results['seconds']:.0f} s; written to {out})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

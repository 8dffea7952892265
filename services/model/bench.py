"""`python -m services.model.bench`: throughput of the model stage alone, per backend, precision and batch.

No gRPC, no router: each runner is driven directly (as one instance's thread drives it), so the figures are
what the backend gives. For every available backend (torch on the CPU, torch on CUDA, TensorRT) at FP32 and
FP16 it warms up, then runs each batch size for `--seconds` and prints items/s and the latency per batch;
`--json FILE` writes them for scripts. On a GPU machine it also checks the targets the model stage is built
for: TensorRT FP16 ≥ 2× torch eager FP32 at batch 32, torch CUDA ≥ 20× torch CPU at batch 32.

    python -m services.model.bench --model digits_cnn --model-dir models
    python -m services.model.bench --model refcnn --batches 1 8 32 128 --seconds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.model.backends import TorchOptions, TorchRunner, tensorrt_status
from services.model.networks import NETWORKS, Network, network

DEFAULT_BATCHES = (1, 8, 32, 128)
#: (backend label, precision) pairs compared against each other for the targets.
TARGETS = (
    ("tensorrt fp16 / torch-cuda fp32 at batch 32", ("tensorrt", "fp16"), ("torch-cuda", "fp32"), 2.0),
    ("torch-cuda fp32 / torch-cpu fp32 at batch 32", ("torch-cuda", "fp32"), ("torch-cpu", "fp32"), 20.0),
)


@dataclass(frozen=True, slots=True)
class Figure:
    """One measurement."""

    model: str
    backend: str
    precision: str
    batch: int
    items_per_s: float
    ms_per_batch: float
    batches: int


def _runner(backend: str, net: Network, version_dir: Path | None, precision: str, cache: str | None):
    if backend == "torch-cpu":
        return TorchRunner(
            net, version_dir, device="cpu", precision=precision, threads=torch.get_num_threads()
        )
    if backend == "torch-cuda":
        return TorchRunner(net, version_dir, device="cuda:0", precision=precision, options=TorchOptions())
    if backend == "torch-cuda-graphs":
        options = TorchOptions(cuda_graphs=True)
        return TorchRunner(net, version_dir, device="cuda:0", precision=precision, options=options)
    from services.model.tensorrt import TensorRTRunner

    return TensorRTRunner(net, version_dir, device="cuda:0", precision=precision, cache_dir=cache)


def available_backends() -> list[str]:
    """torch-cpu always; torch-cuda (and its CUDA-graph path) with a GPU; tensorrt when it can run."""
    found = ["torch-cpu"]
    if torch.cuda.is_available():
        found += ["torch-cuda", "torch-cuda-graphs"]
    if tensorrt_status()[0]:
        found.append("tensorrt")
    return found


def measure(runner, net: Network, batch: int, seconds: float, model: str) -> Figure:
    """Run `batch`-sized batches for about `seconds` (after a warm-up) and time them."""
    inputs = net.example(batch)
    for _ in range(3):
        runner.run(inputs)
    count, started = 0, time.perf_counter()
    while True:
        runner.run(inputs)  # outputs come back to the host, so each call includes its synchronisation
        count += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds and count >= 3:
            break
    return Figure(model, "", "", batch, count * batch / elapsed, 1000 * elapsed / count, count)


def run(
    model: str,
    *,
    version_dir: Path | None,
    backends: Sequence[str],
    precisions: Sequence[str],
    batches: Sequence[int],
    seconds: float,
    engine_cache: str | None = None,
) -> list[Figure]:
    """Every (backend, precision, batch) figure; a backend that fails to load is reported and skipped."""
    net = network(model)
    figures = []
    for backend in backends:
        for precision in precisions:
            try:
                runner = _runner(backend, net, version_dir, precision, engine_cache)
                runner.load()
            except Exception as exc:
                print(f"{backend} {precision}: cannot load ({exc})", flush=True)
                continue
            for batch in batches:
                if batch > net.max_batch_size:
                    continue
                figure = measure(runner, net, batch, seconds, model)
                figure = Figure(**{**asdict(figure), "backend": backend, "precision": precision})
                figures.append(figure)
                print(
                    f"{model:11} {backend:17} {precision}  batch {batch:4}  {figure.items_per_s:12,.0f} items/s"
                    f"  {figure.ms_per_batch:9.3f} ms/batch",
                    flush=True,
                )
            runner.unload()
    return figures


def check_targets(figures: Sequence[Figure], batch: int = 32) -> list[str]:
    """The targets that can be checked with these figures, each with its ratio and PASS/FAIL."""
    by = {(f.backend, f.precision): f.items_per_s for f in figures if f.batch == batch}
    lines = []
    for label, top, bottom, needed in TARGETS:
        if top in by and bottom in by:
            ratio = by[top] / by[bottom]
            lines.append(
                f"{label}: {ratio:.1f}× (target ≥ {needed:.0f}×) {'PASS' if ratio >= needed else 'FAIL'}"
            )
        else:
            lines.append(f"{label}: not measured here ({'/'.join(top)} or {'/'.join(bottom)} unavailable)")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, measure, print the figures and the targets."""
    parser = argparse.ArgumentParser(
        prog="python -m services.model.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", choices=list(NETWORKS), default="digits_cnn", help="default %(default)s")
    parser.add_argument("--model-dir", default="models", help="repository with digits_cnn/1/model.pt")
    parser.add_argument("--version", default="1")
    parser.add_argument("--backends", nargs="+", default=None, help="default: every one available here")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "fp16"], choices=["fp32", "fp16"])
    parser.add_argument("--batches", nargs="+", type=int, default=list(DEFAULT_BATCHES))
    parser.add_argument("--seconds", type=float, default=2.0, help="per figure; default %(default)s")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--engine-cache", default=None, help="TensorRT engine cache folder")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    net = network(args.model)
    version_dir = Path(args.model_dir) / args.model / args.version if net.weights_file else None
    if version_dir is not None and not (version_dir / net.weights_file).is_file():
        from services.model.digits import train

        print(f"no weights in {version_dir}; training digits_cnn there first", flush=True)
        train(args.model_dir, progress=False, version=args.version)
    backends = args.backends or available_backends()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s), "
        f"GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}; "
        f"TensorRT: {tensorrt_status()[1]}",
        flush=True,
    )
    figures = run(
        args.model,
        version_dir=version_dir,
        backends=backends,
        precisions=args.precisions,
        batches=args.batches,
        seconds=args.seconds,
        engine_cache=args.engine_cache,
    )
    for line in check_targets(figures):
        print(line)
    if args.json:
        args.json.write_text(json.dumps([asdict(f) for f in figures], indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The pagenumber example's figures: its fan-out ensemble and its BLS model side by side.

    python -m bench.pagenumber [--duration 20] [--concurrency 8] [--digits 6] [--pages 200] [--out FILE]

Starts `pipeline run` on a repository holding the example's models and the digits CNN (trained as `make
model` trains it, in seconds, unless the tree's repository has it built), then for `pagenumber` (the
ensemble, `for_each` over the crops) and `pagenumber_bls` (the Triton Python model with `async_exec`):

- accuracy: `--pages` held-out pages of `--digits` digits, each read once: the share of pages and of digits
  read right, and whether the two answer the same for every page;
- load: `--concurrency` clients sending such pages back to back for `--duration` seconds: pages per second,
  p50 and p99 latency, the CNN's mean batch over the run (the router's ModelStatistics), and the CPU each
  process spent per page (user and system time from /proc).

Prints a line of JSON per model (and writes them to `--out`), then a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.running import REPO, Pipeline, mean_batch, per_request, wait_ready
from examples.pagenumber import held_out_pages
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import Tensor, response_tensors

MODELS = ("pagenumber", "pagenumber_bls")
#: What the repository of the run holds: the example and the CNN it calls.
ENTRIES = ("pagenumber", "pagenumber_segment", "pagenumber_join", "pagenumber_bls", "digits_cnn")


def repository(root: Path) -> Path:
    """The example's models and the digits CNN, built where the tree's repository lacks its file."""
    from examples.models.build import build

    tree = REPO / "model_repository"
    for name in ENTRIES:
        shutil.copytree(tree / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    if not (root / "digits_cnn" / "1" / "model.pt").is_file():
        build(root, ["digits_cnn"], progress=False, report=print)
    return root


def request(model: str, page: bytes) -> pb.ModelInferRequest:
    array = np.empty(1, dtype=object)
    array[0] = page
    tensor = Tensor.from_array("PAGE", array)
    message = pb.ModelInferRequest(model_name=model)
    message.inputs.add(name="PAGE", datatype=tensor.datatype, shape=tensor.shape)
    message.raw_input_contents.append(tensor.raw)
    return message


async def read_pages(stub: pb_grpc.GRPCInferenceServiceStub, model: str, pages: list[bytes]) -> list[str]:
    """Each page's number as `model` reads it (16 pages in flight at a time)."""
    limit = asyncio.Semaphore(16)

    async def one(page: bytes) -> str:
        async with limit:
            reply = await stub.ModelInfer(request(model, page), timeout=60)
        return bytes(response_tensors(reply)["NUMBER"].to_array()[0]).decode()

    return await asyncio.gather(*(one(page) for page in pages))


async def load(
    stub: pb_grpc.GRPCInferenceServiceStub, model: str, pages: list[bytes], concurrency: int, duration: float
) -> list[float]:
    """Send pages back to back from `concurrency` clients for `duration` seconds: each call's latency."""
    latencies: list[float] = []
    stop = time.monotonic() + duration

    async def client(offset: int) -> None:
        i = offset
        while time.monotonic() < stop:
            started = time.perf_counter()
            await stub.ModelInfer(request(model, pages[i % len(pages)]), timeout=60)
            latencies.append(time.perf_counter() - started)
            i += concurrency

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return latencies


async def cnn_statistics(stub: pb_grpc.GRPCInferenceServiceStub) -> pb.ModelStatistics:
    """The digits CNN's statistics as the router counts them: its calls and the batches they formed."""
    reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="digits_cnn"), timeout=10)
    return reply.model_stats[0]


async def measure(pipeline: Pipeline, args: argparse.Namespace) -> list[dict[str, Any]]:
    accuracy_pages = held_out_pages(args.pages, args.digits, seed=1)
    load_pages = [page for page, _ in held_out_pages(64, args.digits, seed=2)]
    truth = [number for _, number in accuracy_pages]
    results = []
    answers: dict[str, list[str]] = {}
    async with grpc.aio.insecure_channel(pipeline.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for model in MODELS:
            await wait_ready(pipeline.router, model)
            await load(stub, model, load_pages, args.concurrency, 2.0)  # warm up
            answers[model] = await read_pages(stub, model, [page for page, _ in accuracy_pages])
            right = [a == t for a, t in zip(answers[model], truth, strict=True)]
            digits = sum(
                sum(x == y for x, y in zip(a, t, strict=False)) if len(a) == len(t) else 0
                for a, t in zip(answers[model], truth, strict=True)
            )
            before, cpu_before = await cnn_statistics(stub), pipeline.cpu()
            started = time.monotonic()
            latencies = await load(stub, model, load_pages, args.concurrency, args.duration)
            elapsed = time.monotonic() - started
            after, cpu_after = await cnn_statistics(stub), pipeline.cpu()
            cpu = per_request(cpu_before, cpu_after, len(latencies))
            results.append(
                {
                    "model": model,
                    "concurrency": args.concurrency,
                    "digits": args.digits,
                    "pages_per_s": len(latencies) / elapsed,
                    "p50_ms": statistics.median(latencies) * 1e3,
                    "p99_ms": float(np.percentile(latencies, 99)) * 1e3,
                    "cnn_mean_batch": mean_batch(before, after),
                    "cpu_us_per_page": {name: round(us) for name, us in cpu.items()},
                    "page_accuracy": sum(right) / len(right),
                    "digit_accuracy": digits / (len(truth) * args.digits),
                }
            )
    same = answers[MODELS[0]] == answers[MODELS[1]]
    for result in results:
        result["same_answers"] = same
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pagenumber", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per model")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending pages at once")
    parser.add_argument("--digits", type=int, default=6, help="digits per page")
    parser.add_argument("--pages", type=int, default=200, help="held-out pages read for the accuracy")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON lines here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pagenumber-bench-") as tmp:
        root = repository(Path(tmp) / "repository")
        pipeline = Pipeline(root, Path(tmp) / "pipeline.log")
        try:
            results = asyncio.run(measure(pipeline, args))
        finally:
            pipeline.stop()
    lines = [json.dumps(result) for result in results]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    print(
        f"\n{'model':16} {'pages/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'CNN batch':>9} {'CPU us/page (all)':>18} "
        f"{'pages right':>11} {'digits right':>12}"
    )
    for r in results:
        print(
            f"{r['model']:16} {r['pages_per_s']:8.1f} {r['p50_ms']:7.1f} {r['p99_ms']:7.1f} "
            f"{r['cnn_mean_batch'] or 0:9.1f} {r['cpu_us_per_page']['all']:18d} {r['page_accuracy']:11.1%} "
            f"{r['digit_accuracy']:12.1%}"
        )
    for r in results:
        print(f"{r['model']}: CPU us per page by process: {r['cpu_us_per_page']}")
    print(f"same answers both ways: {results[0]['same_answers']}")


if __name__ == "__main__":
    main()

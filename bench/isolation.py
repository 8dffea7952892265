"""Per-model isolation: the latency of one model of a stage while another model of the same stage is abused.

    python -m bench.isolation [--duration 5] [--concurrency 4] [--out FILE]

Starts `pipeline run` on a repository written for the run: Python models that the preprocess service serves
side by side, `fast` (hands its input back), `slow` (one instance, one second a request), `stuck` (one
instance that answers nothing for a minute), `accumulate` (a sequence model, `direct` strategy, one instance
of 4 slots, sequences idle for at most 5 s) and `recurse` (one instance of a BLS model that calls itself).
`fast` is measured through the router by `--concurrency` clients for `--duration` seconds:

- alone;
- while 100 requests of `slow` are in flight (15 s deadlines, sent again as each is answered);
- while 200 requests of `stuck` are held (10 s deadlines, sent again as each fails);
- while 1,000 `sequence_start` requests of `accumulate` that never end are sent (5 s deadlines);
- while 16 callers at once call `recurse` (more than its one instance), each 10 s deadline.

Prints a line of JSON per case (p50 and p99 of `fast` in ms, its errors, and what the abuse got back) and a
table with each case's p99 beside `fast`'s p99 alone.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.running import Pipeline, wait_ready
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc

TENSORS = """input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""

#: Hands X back as Y after `delay` seconds.
SLEEPER = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep({delay})
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests
        ]
"""

#: Calls itself once with its input (as `depth` 1), then answers; a call at depth 1 answers at once.
RECURSE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            if request.parameters() and '"depth"' in request.parameters():
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.as_numpy())]))
                continue
            call = pb_utils.InferenceRequest(
                model_name="recurse", inputs=[x], requested_output_names=["Y"], parameters={"depth": 1}
            )
            reply = call.exec()
            if reply.has_error():
                responses.append(pb_utils.InferenceResponse(error=reply.error()))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(reply, "Y")]))
        return responses
"""

ACCUMULATE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests
        ]
"""
ACCUMULATE_CONFIG = (
    'backend: "python"\nmax_batch_size: 4\n'
    + TENSORS
    + "sequence_batching { direct { } max_sequence_idle_microseconds: 5000000 }\n"
    + "instance_group [ { count: 1, kind: KIND_CPU } ]\n"
)


def repository(root: Path) -> None:
    """Write the run's models under `root`."""
    one = "instance_group [ { count: 1, kind: KIND_CPU } ]\n"
    models = {
        "fast": (SLEEPER.format(delay=0), 'backend: "python"\nmax_batch_size: 0\n' + TENSORS),
        "slow": (SLEEPER.format(delay=1.0), 'backend: "python"\nmax_batch_size: 0\n' + TENSORS + one),
        "stuck": (SLEEPER.format(delay=60.0), 'backend: "python"\nmax_batch_size: 0\n' + TENSORS + one),
        "recurse": (RECURSE, 'backend: "python"\nmax_batch_size: 0\n' + TENSORS + one),
        "accumulate": (ACCUMULATE, ACCUMULATE_CONFIG),
    }
    for name, (source, config) in models.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n' + config)
        (root / name / "1" / "model.py").write_text(source)


def request(model: str, request_id: str = "", batched: bool = False) -> pb.ModelInferRequest:
    x = np.arange(4, dtype=np.float32).reshape((1, 4) if batched else (4,))
    tensor = pb.ModelInferRequest.InferInputTensor(name="X", datatype="FP32", shape=list(x.shape))
    return pb.ModelInferRequest(
        model_name=model, id=request_id, inputs=[tensor], raw_input_contents=[x.tobytes()]
    )


async def measure(stub: pb_grpc.GRPCInferenceServiceStub, duration: float, concurrency: int) -> dict:
    """`fast`'s latencies over `duration` seconds, `concurrency` clients in a closed loop."""
    latencies: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    end = time.monotonic() + duration

    async def client() -> None:
        while time.monotonic() < end:
            started = time.perf_counter()
            try:
                await stub.ModelInfer(request("fast"), timeout=15)
            except grpc.aio.AioRpcError as err:
                errors[err.code().name] += 1
                continue
            latencies.append((time.perf_counter() - started) * 1e3)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    ms = np.array(latencies) if latencies else np.array([float("nan")])
    return {
        "answered": len(latencies),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "errors": dict(errors),
    }


Abuse = Callable[[pb_grpc.GRPCInferenceServiceStub, asyncio.Event, collections.Counter[str]], Awaitable[None]]


def flood(model: str, inflight: int, deadline: float) -> Abuse:
    """`inflight` requests of `model` held at once, each sent again once answered or failed."""

    async def run(stub, stop: asyncio.Event, outcomes: collections.Counter[str]) -> None:
        async def one() -> None:
            while not stop.is_set():
                try:
                    await stub.ModelInfer(request(model), timeout=deadline)
                    outcomes["OK"] += 1
                except grpc.aio.AioRpcError as err:
                    outcomes[err.code().name] += 1

        await asyncio.gather(*(one() for _ in range(inflight)))

    return run


def sequence_starts(count: int, deadline: float) -> Abuse:
    """`count` sequences started and never ended, all sent at once."""

    async def run(stub, stop: asyncio.Event, outcomes: collections.Counter[str]) -> None:
        async def start(sequence: int) -> None:
            started = request("accumulate", batched=True)
            started.parameters["sequence_id"].int64_param = 1_000_000 + sequence
            started.parameters["sequence_start"].bool_param = True
            try:
                await stub.ModelInfer(started, timeout=deadline)
                outcomes["OK"] += 1
            except grpc.aio.AioRpcError as err:
                outcomes[err.code().name] += 1

        await asyncio.gather(*(start(i) for i in range(count)))
        await stop.wait()

    return run


CASES: dict[str, Abuse | None] = {
    "alone": None,
    "slow model, 100 in flight": flood("slow", 100, 15.0),
    "stuck model, 200 held": flood("stuck", 200, 10.0),
    "1,000 abandoned sequence starts": sequence_starts(1000, 5.0),
    "self-calling model, 16 callers": flood("recurse", 16, 10.0),
}


async def run_case(address: str, abuse: Abuse | None, duration: float, concurrency: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel, grpc.aio.insecure_channel(address) as other:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stop, outcomes = asyncio.Event(), collections.Counter[str]()
        task = None
        if abuse is not None:
            task = asyncio.ensure_future(abuse(pb_grpc.GRPCInferenceServiceStub(other), stop, outcomes))
            await asyncio.sleep(1.0)  # the abuse is under way: its requests fill the queues
        figures = await measure(stub, duration, concurrency)
        stop.set()
        if task is not None:
            await task
        return {**figures, "abuse": dict(outcomes)}


async def cases(address: str, duration: float, concurrency: int) -> list[dict[str, Any]]:
    for model in ("fast", "slow", "stuck", "recurse", "accumulate"):
        await wait_ready(address, model)
    results = []
    for name, abuse in CASES.items():
        result = {"case": name, **await run_case(address, abuse, duration, concurrency)}
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def table(results: list[dict[str, Any]]) -> str:
    alone = results[0]["p99_ms"]
    lines = [
        "| case | fast p50 ms | fast p99 ms | p99 / alone | fast errors | the abused model got |",
        "|---|---:|---:|---:|---|---|",
    ]
    for r in results:
        abuse = ", ".join(f"{k} {v}" for k, v in sorted(r["abuse"].items())) or "-"
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "none"
        lines.append(
            f"| {r['case']} | {r['p50_ms']} | {r['p99_ms']} | {r['p99_ms'] / alone:.2f} | {errors} | {abuse} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds `fast` is measured per case")
    parser.add_argument("--concurrency", type=int, default=4, help="clients of `fast` at once")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="isolation-") as scratch:
        root = Path(scratch) / "models"
        repository(root)
        pipeline = Pipeline(root, Path(scratch) / "pipeline.log")
        try:
            results = asyncio.run(cases(pipeline.router, args.duration, args.concurrency))
        finally:
            pipeline.stop()
    print(table(results))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

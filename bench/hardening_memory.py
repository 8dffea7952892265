"""The router's memory under large requests and a stream no one reads: `python -m bench.hardening_memory`.

Starts the example pipeline (`pipeline run` on the example repository) and measures the router's peak
resident memory (VmHWM) through two abuses, with the budget of bytes in flight off (`PIPELINE_MAX_INFLIGHT_MB
0`) and at its default:

- **unary**: 24 clients send valid 51 MB requests for `embeddings_pool` (`TOKEN_EMBEDDINGS` FP32
  [64, 512, 384]) back to back for `--duration` seconds; answered and refused (UNAVAILABLE: retryable)
  requests are counted;
- **stream**: one client writes 2 MB requests on one `ModelStreamInfer` stream and never reads a response,
  for `--duration` seconds: how many the router took, and its memory.

Each configuration runs in a pipeline of its own, so one's peak does not hide the other's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

from bench.running import REPO, Pipeline
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import Tensor

CONFIGURATIONS = {"no budget": "0", "default budget": ""}
#: Options of every client channel: messages as large as the servers take.
OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def _request(tokens: int, batch: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="embeddings_pool")
    for name, array in (
        ("TOKEN_EMBEDDINGS", np.ones((batch, tokens, 384), np.float32)),
        ("ATTENTION_MASK", np.ones((batch, tokens), np.int64)),
    ):
        tensor = Tensor.from_array(name, array)
        request.inputs.add(name=name, datatype=tensor.datatype, shape=list(array.shape))
        request.raw_input_contents.append(tensor.raw)
    return request


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for {pid}")


async def unary(address: str, duration: float, clients: int = 24) -> Counter[str]:
    """`clients` clients sending 51 MB requests back to back: how each was answered."""
    request = _request(512, 64)
    outcomes: Counter[str] = Counter()
    until = time.monotonic() + duration

    async def client() -> None:
        async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            while time.monotonic() < until:
                try:
                    await stub.ModelInfer(request, timeout=60)
                    outcomes["OK"] += 1
                except grpc.aio.AioRpcError as err:
                    outcomes[err.code().name] += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes


async def unread_stream(address: str, duration: float, requests: int = 1000) -> int:
    """One stream, 2 MB requests written for `duration` seconds and never read: how many were written."""
    request = _request(1365, 1)
    written = 0
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()

        async def write() -> None:
            nonlocal written
            for _ in range(requests):
                await call.write(request)
                written += 1

        with contextlib.suppress(TimeoutError):  # the router stopped reading
            await asyncio.wait_for(write(), duration)
        call.cancel()
    return written


def measure(name: str, budget: str, duration: float, folder: Path) -> dict:
    env = {"PIPELINE_MAX_INFLIGHT_MB": budget} if budget else {}
    pipeline = Pipeline(REPO / "model_repository", folder / f"{name.replace(' ', '-')}.log", env=env)
    try:
        router = pipeline.pids["router"]
        base = peak_rss_mb(router)
        outcomes = asyncio.run(unary(pipeline.router, duration))
        after_unary = peak_rss_mb(router)
        written = asyncio.run(unread_stream(pipeline.router, duration))
        after_stream = peak_rss_mb(router)
    finally:
        pipeline.stop()
    return {
        "configuration": name,
        "router_peak_rss_mb_at_start": round(base),
        "unary_answered": outcomes.get("OK", 0),
        "unary_refused_unavailable": outcomes.get("UNAVAILABLE", 0),
        "unary_failed_otherwise": sum(n for code, n in outcomes.items() if code not in ("OK", "UNAVAILABLE")),
        "router_peak_rss_mb_after_unary": round(after_unary),
        "stream_requests_written_unread": written,
        "router_peak_rss_mb_after_stream": round(after_stream),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of each load")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hardening-memory-") as tmp:
        for name, budget in CONFIGURATIONS.items():
            print(json.dumps(measure(name, budget, args.duration, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()

"""A closed-loop HTTP load generator: `concurrency` clients each POST one body, wait for its answer and send
again, for `warmup` then `duration` seconds; the figures are those of the measured interval.

    python -m bench.http_load --url http://127.0.0.1:8080/predictions/model [--concurrency 8]
        [--warmup 2] [--duration 10] [--json-out FILE]

It measures as the peers' load generator does in its `http` mode (`loadgen/loadgen.py` of the peers' folder,
which takes the same flags): the body is the same 3x64x64 UINT8 image (12,288 bytes, numpy's generator seeded
with 1) sent as application/octet-stream over one aiohttp session without a connection limit; a request
counts where it started after the warm-up and ended before the stop; p50 and p99 are the latencies at those
ranks. An answer other than 200 is an error (the client waits 10 ms before its next request). Prints and
writes a list of one row: concurrency, completed, throughput (requests/s), p50_ms, p99_ms, errors,
first_error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np


def image() -> bytes:
    """The request body: a 3x64x64 UINT8 image."""
    return np.random.default_rng(1).integers(0, 256, size=(1, 3, 64, 64), dtype=np.uint8).tobytes()


def percentile(latencies: list[float], q: float) -> float:
    """The latency at rank `q` of the sorted `latencies`, in ms."""
    if not latencies:
        return float("nan")
    return latencies[min(len(latencies) - 1, int(len(latencies) * q))] * 1e3


async def level(url: str, body: bytes, concurrency: int, warmup: float, duration: float) -> dict[str, Any]:
    """One level of load: its figures."""
    latencies: list[float] = []
    errors: list[str] = []
    headers = {"Content-Type": "application/octet-stream"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        measured, stop = start + warmup, start + warmup + duration

        async def client() -> None:
            while (sent := time.perf_counter()) < stop:
                try:
                    async with session.post(url, data=body, headers=headers) as response:
                        text = await response.read()
                        if response.status != 200:
                            raise RuntimeError(f"HTTP {response.status}: {text[:200]!r}")
                    done = time.perf_counter()
                    if sent >= measured and done <= stop:
                        latencies.append(done - sent)
                except Exception as exc:  # every failure is counted, and the client goes on
                    errors.append(repr(exc)[:300])
                    await asyncio.sleep(0.01)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    latencies.sort()
    return {
        "concurrency": concurrency,
        "completed": len(latencies),
        "throughput": len(latencies) / duration,
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.http_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["http"], default="http", help="the only mode: HTTP POST")
    parser.add_argument("--url", required=True, help="the URL to POST the image to")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the measure")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--label", default="", help="printed before the figures")
    parser.add_argument("--json-out", type=Path, default=None, help="write the row here too")
    args = parser.parse_args(argv)
    if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        parser.error("--url: this load generator sends to this machine only")
    row = asyncio.run(level(args.url, image(), args.concurrency, args.warmup, args.duration))
    print(
        f"{args.label} conc={row['concurrency']:3d} thr={row['throughput']:8.1f}/s p50={row['p50_ms']:8.2f}ms "
        f"p99={row['p99_ms']:8.2f}ms n={row['completed']} err={row['errors']} {row['first_error'] or ''}",
        flush=True,
    )
    if args.json_out is not None:
        args.json_out.write_text(json.dumps([row], indent=1))


if __name__ == "__main__":
    main()

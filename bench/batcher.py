"""The dynamic batcher's own cost against queue length: `python -m bench.batcher`.

Closed-loop clients keep a queue of about `depth` requests in front of a stage that answers at once
(one batch in flight, batches of `--max-batch-size`), so every request pays a submit, a place in the queue
and a dispatch. The figure is the batcher's CPU time per request; it should not grow with the queue.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence

from pipeline.protocol.types import BatchingConfig
from pipeline.router.scheduling.batching import DynamicBatcher


async def _measure(depth: int, requests: int, max_batch_size: int, deadline: bool) -> tuple[float, float]:
    async def execute(payloads: Sequence[int]) -> list[int]:
        await asyncio.sleep(0)  # a stage call yields to the loop at least once
        return list(payloads)

    config = BatchingConfig(max_batch_size=max_batch_size, max_queue_size=0, max_inflight_batches=1)
    batcher: DynamicBatcher[int, int] = DynamicBatcher("bench", execute, config)
    batcher.start()
    left = requests

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            until = time.monotonic() + 60 if deadline else None
            await batcher.submit(left, deadline=until)

    cpu = time.process_time()
    await asyncio.gather(*(client() for _ in range(depth)))
    cpu = time.process_time() - cpu
    await batcher.aclose()
    return cpu / requests * 1e6, batcher.stats.execution_count and requests / batcher.stats.execution_count


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.batcher", description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--depths", default="1,4,16,64,256,1024")
    args = parser.parse_args(argv)
    print("| queue depth | µs CPU per request | with a deadline each | mean batch |")
    print("|---:|---:|---:|---:|")
    for depth in (int(d) for d in args.depths.split(",")):
        plain, batch = asyncio.run(_measure(depth, args.requests, args.max_batch_size, deadline=False))
        timed, _ = asyncio.run(_measure(depth, args.requests, args.max_batch_size, deadline=True))
        print(f"| {depth} | {plain:.1f} | {timed:.1f} | {batch:.1f} |", flush=True)


if __name__ == "__main__":
    main()

"""Load processes (`--processes N`): each runs its share of every level and sends back its counts."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import time
from collections.abc import Sequence
from typing import Any

import uvloop

from pipeline.tools.bench.load import drive
from pipeline.tools.bench.options import BenchError, BenchOptions, Level
from pipeline.tools.bench.payloads import Payloads


def _child_main(conn: Any, options: BenchOptions, payload: Any) -> None:
    """A load process: connects, says "ready", then runs each level it is sent until it is sent None."""
    uvloop.run(_child_loop(conn, options, payload))


async def _child_loop(conn: Any, options: BenchOptions, payload: Any) -> None:
    loop = asyncio.get_running_loop()
    endpoint = options.endpoint()
    try:
        call = options.call(endpoint)
        await endpoint.ready()
        conn.send("ready")
        while (command := await loop.run_in_executor(None, conn.recv)) is not None:
            level, start_wall, kwargs = command
            # Processes share wall-clock time, not perf_counter origins: convert once.
            start = time.perf_counter() + (start_wall - time.time())
            tally = await drive(call, payload, level, start=start, **kwargs)
            conn.send(tally.raw())
    finally:
        await endpoint.close()


class LoadPool:
    """Worker processes that run each level's share of the load, started once for the whole run."""

    def __init__(self, count: int, options: BenchOptions, payload: Any) -> None:
        context = multiprocessing.get_context("spawn")  # fork and gRPC's threads do not mix
        self.conns = []
        self.processes = []
        for index in range(count):
            parent, child = context.Pipe()
            if isinstance(payload, Payloads):
                payload = dataclasses.replace(payload, salt=index + 1)
            process = context.Process(target=_child_main, args=(child, options, payload), daemon=True)
            process.start()
            self.conns.append(parent)
            self.processes.append(process)

    async def ready(self, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        for conn, process in zip(self.conns, self.processes, strict=True):
            if not await loop.run_in_executor(None, conn.poll, timeout):
                raise BenchError(f"load process {process.pid} did not start within {timeout:.0f}s")
            conn.recv()

    async def run(self, levels: Sequence[Level], start_wall: float, kwargs: dict[str, Any]) -> list[dict]:
        loop = asyncio.get_running_loop()
        for conn, level in zip(self.conns, levels, strict=True):
            conn.send((level, start_wall, kwargs))
        return list(await asyncio.gather(*(loop.run_in_executor(None, c.recv) for c in self.conns)))

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()

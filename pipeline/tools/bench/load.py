"""The load of one process: closed-loop workers or open-loop arrivals, every request counted once."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from pipeline.tools.bench.endpoints import Call, EndpointError
from pipeline.tools.bench.options import Level
from pipeline.tools.bench.payloads import Payloads


class Tally:
    """Counters shared by one process's workers (all on one event loop, so no locks)."""

    __slots__ = (
        "dropped",
        "errors",
        "firsts",
        "gaps",
        "latencies",
        "ok",
        "sent",
        "streamed",
        "window_errors",
    )

    def __init__(self) -> None:
        self.sent = self.ok = self.dropped = 0
        self.errors: Counter[str] = Counter()
        self.window_errors: Counter[str] = Counter()
        self.latencies: list[float] = []
        #: Streamed requests (`--stream`) whose last response arrived in the measured interval: the time
        #: to each one's first response, the gaps between its responses, and their responses in all.
        self.firsts: list[float] = []
        self.gaps: list[float] = []
        self.streamed = 0

    def raw(self) -> dict[str, Any]:
        """A picklable summary, to send from a worker process."""
        return {
            "sent": self.sent,
            "ok": self.ok,
            "dropped": self.dropped,
            "errors": dict(self.errors),
            "window_errors": dict(self.window_errors),
            "latencies": np.asarray(self.latencies, dtype=np.float64),
            "firsts": np.asarray(self.firsts, dtype=np.float64),
            "gaps": np.asarray(self.gaps, dtype=np.float64),
            "streamed": self.streamed,
        }


def _error_code(err: BaseException) -> str:
    if isinstance(err, EndpointError):
        return err.code
    return f"CLIENT_{type(err).__name__}"


#: One request of the load, sent when called with the instant its latency runs from (`time.perf_counter`).
Send = Callable[[float], Coroutine[Any, Any, None]]


async def drive(
    call: Call,
    payload: Any,
    level: Level,
    *,
    start: float,
    warmup: float,
    duration: float,
    timeout: float,
    max_inflight: int = 10_000,
    seed: int = 0,
    tally: Tally | None = None,
) -> Tally:
    """Send `payload` through `call` at `level` from `start` (a `time.perf_counter` instant) and count.

    Every request sent gets exactly one count, in `ok` or in `errors` by status code: sending stops at the
    end of the interval and in-flight requests are awaited. Latencies are kept for the successes whose
    response arrives in the measured interval; in the open loop they run from the scheduled arrival, so a
    generator that falls behind shows up in them instead of hiding it.
    """
    tally = tally if tally is not None else Tally()
    t_meas = start + warmup
    t_stop = t_meas + duration
    delay = start - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)

    payloads = payload if isinstance(payload, Payloads) else Payloads([payload])
    send = _sender(call, payloads, timeout, tally, t_meas, t_stop)
    if level.kind == "concurrency":
        await _closed_loop(send, int(level.value), t_stop, tally)
    elif level.value > 0:
        await _open_loop(send, level, start, t_stop, max_inflight, seed, tally)
    return tally


def _sender(
    call: Call, payloads: Payloads, timeout: float, tally: Tally, t_meas: float, t_stop: float
) -> Send:
    """One request: the next payload sent and awaited, its outcome counted, and its latency kept where its
    response arrives in the measured interval (`t_meas` to `t_stop`); for a streamed request, also the time
    to its first response and the gaps between its responses."""
    now = time.perf_counter
    latencies, firsts, gaps = tally.latencies, tally.firsts, tally.gaps
    errors, window_errors = tally.errors, tally.window_errors

    async def one(t0: float) -> None:
        try:
            arrivals = await call(payloads.next(), timeout)
        except Exception as err:  # every failure is a counted outcome, never a crash of the generator
            code = _error_code(err)
            errors[code] += 1
            if t_meas <= now() <= t_stop:
                window_errors[code] += 1
            return
        t1 = now()
        tally.ok += 1
        if t_meas <= t1 <= t_stop:
            latencies.append(t1 - t0)
            if arrivals:
                firsts.append(arrivals[0] - t0)
                gaps.extend(later - earlier for earlier, later in itertools.pairwise(arrivals))
                tally.streamed += len(arrivals)

    return one


async def _closed_loop(send: Send, workers: int, t_stop: float, tally: Tally) -> None:
    """`workers` workers, each sending its next request as soon as the previous one returns, until `t_stop`."""
    now = time.perf_counter

    async def worker() -> None:
        while (t0 := now()) < t_stop:
            tally.sent += 1
            await send(t0)

    await asyncio.gather(*(worker() for _ in range(workers)))


async def _open_loop(
    send: Send, level: Level, start: float, t_stop: float, max_inflight: int, seed: int, tally: Tally
) -> None:
    """Arrivals at `level.value` per second from `start` until `t_stop`, whether or not earlier requests have
    returned: Poisson for a "rate" level, evenly spaced for a "constant" one. An arrival with `max_inflight`
    requests outstanding is dropped, not sent."""
    now = time.perf_counter
    rng = np.random.default_rng(seed)
    chunk = max(64, int(level.value))
    pending: set[asyncio.Task[None]] = set()
    scheduled = start
    while True:
        gaps = rng.exponential(1.0 / level.value, chunk) if level.kind == "rate" else None
        for i in range(chunk):
            scheduled += 1.0 / level.value if gaps is None else float(gaps[i])
            if scheduled >= t_stop:
                break
            wait = scheduled - now()
            if wait > 0:
                await asyncio.sleep(wait)
            if len(pending) >= max_inflight:
                tally.dropped += 1
                continue
            tally.sent += 1
            task = asyncio.create_task(send(scheduled))
            pending.add(task)
            task.add_done_callback(pending.discard)
        else:
            continue
        break
    if pending:
        await asyncio.gather(*pending)


def arrivals(level: Level, arrival: str) -> Level:
    """The level `drive` runs for `--arrival`: a "constant" level for evenly spaced arrivals at a rate."""
    # Constant arrivals reuse the "rate" level with evenly spaced gaps; `drive` tells them apart by kind.
    return Level("constant", level.value) if level.kind == "rate" and arrival == "constant" else level


def share(level: Level, processes: int) -> list[Level]:
    """Split a level over worker processes: concurrency as evenly as whole workers allow, rate evenly."""
    if level.kind == "concurrency":
        total = int(level.value)
        return [Level("concurrency", total // processes + (i < total % processes)) for i in range(processes)]
    return [Level(level.kind, level.value / processes) for _ in range(processes)]

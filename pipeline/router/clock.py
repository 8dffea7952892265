"""The batcher's time: monotonic time, waiting and timers, behind a seam that tests replace.

`Clock` is the event loop's time; `ManualClock` moves only when a test says so, which makes every timing
rule of the batcher (delays, deadlines, queue timeouts) testable without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Timer(Protocol):
    """A scheduled callback that can still be called off."""

    def cancel(self) -> None: ...


class Clock:
    """Monotonic time, waiting and timers; tests substitute `ManualClock`."""

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` on the event loop at the time `when` (on this clock) unless cancelled first."""
        loop = asyncio.get_running_loop()
        return loop.call_at(loop.time() + (when - self.now()), callback)

    async def wait(self, event: asyncio.Event, until: float | None) -> None:
        """Wait until `event` is set or the time `until` comes, whichever is first."""
        timeout = None if until is None else max(0.0, until - self.now())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)


class ManualClock(Clock):
    """A clock that moves only when told to: for deterministic tests of delays and deadlines."""

    def __init__(self, start: float = 1000.0) -> None:
        self.time = start
        self._waiters: list[tuple[float, asyncio.Event]] = []
        self._timers: list[_ManualTimer] = []

    def now(self) -> float:
        return self.time

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = _ManualTimer(when, callback)
        self._timers.append(timer)
        return timer

    async def wait(self, event: asyncio.Event, until: float | None) -> None:
        if until is not None and until <= self.time:
            return
        entry = (until if until is not None else float("inf"), event)
        self._waiters.append(entry)
        try:
            await event.wait()
        finally:
            self._waiters.remove(entry)

    def advance(self, seconds: float) -> None:
        """Move time forward, running every timer and waking every wait whose time has come."""
        self.time += seconds
        due = [t for t in self._timers if t.when <= self.time]
        self._timers = [t for t in self._timers if t.when > self.time]
        for timer in sorted(due, key=lambda t: t.when):
            if not timer.cancelled:
                timer.callback()
        for until, event in list(self._waiters):
            if until <= self.time:
                event.set()


@dataclass(slots=True, eq=False)
class _ManualTimer:
    when: float
    callback: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

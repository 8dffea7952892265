"""The batcher's time: monotonic time and timers, behind a seam that tests replace.

`Clock` is the event loop's time; `ManualClock` moves only when a test says so, which makes every timing
rule of the batcher (delays, deadlines, queue timeouts) testable without sleeping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Timer(Protocol):
    """A scheduled callback that can still be called off."""

    def cancel(self) -> None: ...


class Clock:
    """Monotonic time and timers; tests substitute `ManualClock`."""

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` on the event loop at the time `when` (on this clock) unless cancelled first."""
        loop = asyncio.get_running_loop()
        return loop.call_at(loop.time() + (when - self.now()), callback)


class ManualClock(Clock):
    """A clock that moves only when told to: for deterministic tests of delays and deadlines."""

    def __init__(self, start: float = 1000.0) -> None:
        self.time = start
        self._timers: list[_ManualTimer] = []

    def now(self) -> float:
        return self.time

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = _ManualTimer(when, callback)
        self._timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        """Move time forward, running every timer whose time has come."""
        self.time += seconds
        due = [t for t in self._timers if t.when <= self.time]
        self._timers = [t for t in self._timers if t.when > self.time]
        for timer in sorted(due, key=lambda t: t.when):
            if not timer.cancelled:
                timer.callback()


@dataclass(slots=True, eq=False)
class _ManualTimer:
    when: float
    callback: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

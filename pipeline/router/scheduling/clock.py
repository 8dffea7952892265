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


class Wakeups:
    """Runs a callback on the event loop once the running callback is done (several wake-ups before it runs
    make one run), or at a time on a clock: a scheduler that runs this way costs no task, and no timeout of
    its own, per wake-up."""

    def __init__(self, clock: Clock, callback: Callable[[], None]) -> None:
        self._clock = clock
        self._callback = callback
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken = False
        self._timer: Timer | None = None
        self._at: float | None = None

    @property
    def started(self) -> bool:
        return self._loop is not None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop it runs on, once started."""
        assert self._loop is not None
        return self._loop

    def start(self) -> None:
        """Run the callback on the running event loop from now on."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    def close(self) -> None:
        """No more runs: wake-ups are ignored until `start()`."""
        self._loop = None
        self.at(None)

    def soon(self) -> None:
        """Run the callback once the running callback is done."""
        if not self._woken and self._loop is not None:
            self._woken = True
            self._loop.call_soon(self._run)

    def at(self, when: float | None) -> None:
        """Run the callback at `when` (on the clock), instead of at any time set before; None: never."""
        if when == self._at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = None, when
        if when is not None:
            self._timer = self._clock.call_at(when, self._due)

    def _due(self) -> None:
        self._timer, self._at = None, None
        self.soon()

    def _run(self) -> None:
        self._woken = False
        if self._loop is not None:
            self._callback()

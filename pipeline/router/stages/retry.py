"""The retry policy of stage calls: which call is sent again and when (`StageRetry`), and how many retries
a stage's traffic pays for (`RetryBudget`)."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StageRetry:
    """The one retry layer of stage calls (gRPC's own retry policy is off).

    Only a call the stage did not start is sent again: a transport failure before any answer (the replica
    is gone, or died with the call in flight), or an UNAVAILABLE whose details say NOT_STARTED (a model not
    loaded yet, a full queue, a draining server). A refusal goes to another replica at once, never back to
    the one that refused; a transport failure goes to another replica when there is one, else to the same
    after a jittered backoff. Stage calls are idempotent, which makes a repeat safe. Every retry is also
    paid from the stage's `RetryBudget`.
    """

    #: Calls in all, the first included.
    attempts: int = 3
    initial_backoff: float = 0.05
    max_backoff: float = 0.5
    multiplier: float = 2.0

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1, 2, ...): exponential, with jitter so that the
        calls that failed together do not return together."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        return random.uniform(ceiling / 2, ceiling)


class RetryBudget:
    """Retries of one stage bounded by its traffic, as Finagle's `RetryBudget` and Envoy's retry budgets do.

    Over the last `window` seconds, retries may be at most `ratio` of the calls made, plus `floor`. With
    the defaults (20%, 10 per 10 s): an overloaded stage that refuses everything sees at most 1.2 times
    the calls it would see without retries (plus one a second), so retries cannot turn overload into a
    storm; while a stage with little traffic still rides out a replica that dies with a few batches in
    flight (each replica holds `max_inflight_batches`, usually 1 or 2, so 10 covers several replicas
    failing at once).
    """

    def __init__(
        self,
        ratio: float = 0.2,
        floor: int = 10,
        window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ratio, self.floor, self.window, self._clock = ratio, floor, window, clock
        #: (second, calls, retries) per second of the window, oldest first.
        self._seconds: deque[list[int]] = deque()
        self.calls = self.retries = self.refused = 0  # totals, for metrics and tests

    def _current(self) -> list[int]:
        now = int(self._clock())
        seconds = self._seconds
        while seconds and seconds[0][0] <= now - self.window:
            seconds.popleft()
        if not seconds or seconds[-1][0] != now:
            seconds.append([now, 0, 0])
        return seconds[-1]

    def called(self) -> None:
        """A first attempt was made (a retry is not counted here)."""
        self._current()[1] += 1
        self.calls += 1

    def try_retry(self) -> bool:
        """Take one retry from the budget; False (and nothing taken) when it is spent."""
        current = self._current()
        calls = sum(s[1] for s in self._seconds)
        retries = sum(s[2] for s in self._seconds)
        if retries + 1 > self.ratio * calls + self.floor:
            self.refused += 1
            return False
        current[2] += 1
        self.retries += 1
        return True

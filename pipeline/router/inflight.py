"""The router's door: how many inference requests it holds at once, in all and per model.

It holds at most `max_inflight_requests` (0: no limit) and refuses more with UNAVAILABLE at once, before anything
is kept or queued: under overload the router sheds load at the door instead of holding every request's tensors
until it runs out of memory. One model (an ensemble or a stage model) holds at most three quarters of them, so a
model flooded with requests leaves room for the others.
"""

from __future__ import annotations

from pipeline.protocol.errors import Unavailable


class InflightDoor:
    """The requests the router holds, in all and per model, against `limit` (0: no limit)."""

    __slots__ = ("_models", "held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        #: Per model, its requests held.
        self._models: dict[str, int] = {}

    def enter(self, model: str) -> None:
        """Hold a request of `model`, or refuse it (`Unavailable`) where the router or the model holds its
        share; every `enter` is followed by one `leave`."""
        limit, held = self.limit, self._models.get(model, 0)
        if limit:
            if self.held >= limit:
                raise Unavailable(
                    f"the router is saturated: {self.held} requests in flight (max_inflight_requests "
                    f"{limit}); retry later"
                )
            if held >= limit - limit // 4:
                raise Unavailable(
                    f"model '{model}' has {held} requests in flight at the router, three quarters of what it "
                    f"holds (max_inflight_requests {limit}): the rest is kept for the other models; retry later"
                )
        self.held += 1
        self._models[model] = held + 1

    def leave(self, model: str) -> None:
        """A request of `model` is answered."""
        self.held -= 1
        if self._models[model] == 1:
            del self._models[model]
        else:
            self._models[model] -= 1

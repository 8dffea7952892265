"""The batched models that stage models call (Triton's BLS), learnt so that their batchers may wait for the
calls on their way, as they wait for an ensemble's later steps.

Every request the router sends unbatched to a stage model gets an origin, which goes with it in its call
chain (`CallChain.origin`) and comes back on every call its model makes. The first call of a batched model X
from a request of model M teaches the router that M calls X; from then on each request of M is announced to
X's batcher while it runs (`DynamicBatcher.expect`), until its first call of X comes (it is then expected)
or the request ends (the announcement is taken back). So under load a partial batch of X waits, never past
its delay (`batch_upcoming`), for the calls that requests of M still hold, and a lone call still goes at
once. A request of M that ends without calling X makes the router forget that M calls X, until a call
teaches it again.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.protocol.call_chain import CallChain
from pipeline.router.scheduling.batching import DynamicBatcher


@dataclass(slots=True)
class _Origin:
    model: str
    #: The batchers this request was announced to and has not called yet, by model.
    announced: dict[str, DynamicBatcher[Any, Any]]


class BlsForecast:
    """Origins of the requests sent to stage models, and the batched models each model calls.

    `batchers`: the router's batchers by model (the dispatcher's, whose values hold the batcher first)."""

    def __init__(self, batchers: Mapping[str, tuple[DynamicBatcher[Any, Any], Any]]) -> None:
        self._batchers = batchers
        #: Per calling model, the batched models its requests call.
        self._callees: dict[str, set[str]] = {}
        self._open: dict[str, _Origin] = {}
        # NOTE: unique across the router's worker processes, so a call that reaches another worker than
        # its request's is never taken for one of that worker's own.
        self._prefix = f"{os.getpid():x}."
        self._ids = itertools.count(1)

    def begin(self, model: str) -> str:
        """A request of `model` is sent: its origin, announced to the batchers of the models it calls."""
        origin = f"{self._prefix}{next(self._ids)}"
        announced = {}
        for callee in self._callees.get(model, ()):
            batched = self._batchers.get(callee)
            if batched is not None:
                batcher = batched[0]
                batcher.expect()
                announced[callee] = batcher
        self._open[origin] = _Origin(model, announced)
        return origin

    def end(self, origin: str) -> None:
        """The request of `origin` is answered: what it did not call is taken back, and forgotten."""
        entry = self._open.pop(origin)
        if entry.announced:
            known = self._callees[entry.model]
            for callee, batcher in entry.announced.items():
                batcher.unexpect()
                known.discard(callee)

    def take(self, chain: CallChain | None, callee: str) -> bool:
        """Whether a call of the batched model `callee` that carries `chain` was announced; it is taken up
        now, and the model of its origin learnt to call `callee`."""
        if chain is None or not chain.origin:
            return False
        entry = self._open.get(chain.origin)
        if entry is None:
            return False
        if entry.announced.pop(callee, None) is not None:
            return True
        self._callees.setdefault(entry.model, set()).add(callee)
        return False

"""The order of a sequence's requests on one stream or connection, kept without waiting for answers.

Triton's sequence batcher takes a stream's requests in the order they come: a sequence's next request waits
at its sequence slot while the one before it runs, and joins the batch that forms meanwhile. A server here
that reads a stream (or a frame connection) runs its requests concurrently, so it keeps each sequence's in
order with a `SequenceLine`: a request of a sequence goes on once the one before it has its place in the
sequence's order (`in_line`), not once it is answered. The place is taken where order can no longer change:
the stage's sequence batcher has queued the request, or the router has written it on the one connection to
the stage that holds the sequence. Where neither happens (a unary call, a refusal), the request's end lets
the next one go.
"""

from __future__ import annotations

import asyncio
import contextvars

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.sequences import SEQUENCE_ID

#: The event of the request of a sequence that this task serves, set once the request is in line.
_PLACED: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar(
    "sequence_placed", default=None
)


def in_line() -> None:
    """The request of a sequence this task serves has its place in the sequence's order: the request after
    it on the same stream may go on. (Nothing where the task serves no such request.)"""
    placed = _PLACED.get()
    if placed is not None:
        placed.set()
        _PLACED.set(None)


class Turn:
    """One request's turn in its sequence's line: it waits for the request before it, then serves."""

    __slots__ = ("_key", "_line", "_previous", "placed")

    def __init__(self, line: SequenceLine, key: str, previous: asyncio.Event | None) -> None:
        self._line, self._key, self._previous = line, key, previous
        self.placed = asyncio.Event()

    async def wait(self) -> None:
        """Wait until the request before it is in line (or done); from then on, the task that awaited this
        serves this request (`in_line` speaks for it)."""
        if self._previous is not None:
            await self._previous.wait()
        _PLACED.set(self.placed)

    def done(self, _: object = None) -> None:
        """The request is answered (or given up): the next goes on, whether it took its place or not."""
        self.placed.set()
        self._line.forget(self._key, self.placed)


class SequenceLine:
    """The requests of each sequence on one stream or connection, in the order they came."""

    def __init__(self) -> None:
        #: By sequence (model and id): the event of its latest request.
        self._latest: dict[str, asyncio.Event] = {}

    def turn(self, request: pb.ModelInferRequest) -> Turn | None:
        """The turn of a request of a sequence, after the one before it on this stream (None for a request
        of no sequence). The caller awaits `Turn.wait` in the task that serves the request, and calls
        `Turn.done` when that task ends."""
        if SEQUENCE_ID not in request.parameters:
            return None
        key = f"{request.model_name}\0{request.parameters[SEQUENCE_ID]}"
        turn = Turn(self, key, self._latest.get(key))
        self._latest[key] = turn.placed
        return turn

    def forget(self, key: str, placed: asyncio.Event) -> None:
        if self._latest.get(key) is placed:
            del self._latest[key]

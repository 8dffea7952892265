"""A server's budget of bytes in flight: what bounds its memory, whatever its clients send.

A request costs its server a few times its size while it is served (the message gRPC parsed, the tensors
made of it, what it sends on), and its response as much again until it is sent. `max_inflight_requests`
counts requests; this counts their bytes. A unary request that would take the bytes held past the limit is
refused at once, before it is parsed, with UNAVAILABLE (retryable: the budget frees as responses go out);
a stream's next request is not read until its bytes fit, so a client that stops reading its responses is
not read from either, and gRPC's flow control holds the rest in the client. A request is admitted when
nothing is held whatever its size (it is within `--max-message-mb`), so a large one never starves.

A stream holds at most a quarter of the budget, so one client that never reads cannot take it all.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import Unavailable

#: The share of the budget one stream may hold.
STREAM_SHARE = 4


@dataclass(frozen=True, slots=True)
class Refused:
    """A unary request refused by its size before it was parsed (see `InferenceServicer.infer_request_of`)."""

    size: int


class ByteBudget:
    """Bytes held by the requests and responses in flight, against `limit` (None: no limit)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.held = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, size: int) -> bool:
        return self.limit is None or self.held == 0 or self.held + size <= self.limit

    def fits(self, size: int) -> bool:
        """Whether a unary request of `size` bytes would be admitted now."""
        return not self._waiting and self._fits(size)

    def refusal(self, size: int) -> Unavailable:
        """What a request of `size` bytes that does not fit is refused with."""
        return Unavailable(
            f"the server holds {_mib(self.held)} of requests and responses in flight; a request of "
            f"{_mib(size)} would pass its limit of {_mib(self.limit or 0)} (--max-inflight-mb): try again"
        )

    def admit(self, size: int) -> None:
        """Take `size` bytes for a unary request, or refuse it (`Unavailable`) where they do not fit now."""
        if not self.fits(size):
            raise self.refusal(size)
        self.held += size

    async def wait(self, size: int) -> None:
        """Take `size` bytes for a stream's request, waiting (in turn) until they fit."""
        if not self._waiting and self._fits(size):
            self.held += size
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((size, future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(size)  # granted as it was cancelled: give it back
            else:
                self._waiting.remove((size, future))
            raise

    def charge(self, size: int) -> None:
        """Count `size` bytes made while serving (a response): they are held already, so never refused."""
        self.held += size

    def release(self, size: int) -> None:
        """Give back bytes taken; wake the streams waiting whose turn it is and whose bytes fit."""
        self.held -= size
        while self._waiting and self._fits(self._waiting[0][0]):
            size, future = self._waiting.popleft()
            if not future.done():
                self.held += size
                future.set_result(None)

    def stream_limit(self) -> int | None:
        """The most bytes one stream may hold."""
        return None if self.limit is None else max(1, self.limit // STREAM_SHARE)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


class StreamHold:
    """One stream's bytes in a server's budget: its requests from when they are read, and its responses
    until they are sent. Responses go to `done` with the bytes their sending gives back."""

    def __init__(
        self, budget: ByteBudget, done: asyncio.Queue[tuple[pb.ModelStreamInferResponse, int] | None]
    ) -> None:
        self.budget = budget
        self.done = done
        self.limit = budget.stream_limit()
        self.held = 0
        self._freed = asyncio.Event()

    async def room(self) -> None:
        """Wait while the stream holds its share: its responses are not being taken, so read no further."""
        while self.limit is not None and self.held >= self.limit:
            self._freed.clear()
            await self._freed.wait()

    async def take(self, size: int) -> None:
        """A request read: its bytes, once they fit the server's budget."""
        await self.budget.wait(size)
        self.held += size

    def put(self, response: pb.ModelStreamInferResponse, size: int = 0) -> None:
        """A response to send; `size`: the bytes of its request that go with it."""
        made = response.ByteSize()
        self.budget.charge(made)
        self.held += made
        self.done.put_nowait((response, size + made))

    def give_back(self, size: int) -> None:
        """Bytes sent, or of a request that will send nothing."""
        self.held -= size
        self.budget.release(size)
        self._freed.set()

    def close(self) -> None:
        """The stream ended: everything it still holds goes back."""
        self.budget.release(self.held)
        self.held = 0

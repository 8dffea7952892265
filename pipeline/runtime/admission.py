"""A server's budget of bytes in flight: what bounds its memory, whatever its clients send.

A unary request costs its server about three times its size while it is served (`REQUEST_COST`: the bytes
gRPC received, the message parsed from them, what is sent on), and that is what it takes of the budget;
`max_inflight_requests` counts requests, this counts their bytes. A request past the limit is refused with
UNAVAILABLE (retryable: the budget frees as responses go out), and a gRPC `ModelInfer` is refused at the
door, before its message is read: gRPC receives a message whole before it tells its size, so the door
(`ByteBudget.reserve_read`) sets aside room for what recent requests cost, refuses while the bytes held leave none,
and waits while requests being read took it (their reads end soon). What gRPC buffers of a call not read
is its transport's window, not its message. A request is admitted when nothing is held whatever its size
(it is within `--max-message-mb`), so a large one never starves.

A stream's next request is not read until its bytes fit, so a client that stops reading its responses is
not read from either, and gRPC's flow control holds the rest in the client. A stream holds at most a
quarter of the budget, so one client that never reads cannot take it all.

One connection carries the requests of many models (the router's link to a stage carries all of the stage's
models), so what bounds it must not let one model hold the door for the others: the requests of one model on a
connection (`ModelShares`) hold at most a quarter of the requests it may hold and of the budget. Past that, a
request of that model is refused at once with UNAVAILABLE (as Triton refuses a request past a model's queue),
while the connection goes on reading the requests of the other models: a slow, stuck or flooded model keeps
its trouble to itself.
"""

from __future__ import annotations

import asyncio
import collections

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import Unavailable

#: The share of the budget one stream may hold.
STREAM_SHARE = 4
#: Requests one connection (a frame connection, a `ModelStreamInfer` stream) holds at once, answered or not.
CONNECTION_INFLIGHT = 4096
#: The share of a connection's requests, and of the server's budget, that the requests of one model may hold.
MODEL_SHARE = 4
#: What serving a unary request holds, in multiples of its size: its bytes as received, the message parsed
#: from them, and the request sent on (to a stage, or a model's tensors). Measured on the router: about 3.
REQUEST_COST = 3
#: How much of what requests cost of late the door forgets at each request read: a flood of large requests
#: keeps the door's estimate up, and after it the estimate falls to the size of what comes next.
FORGET = 8


def cost_of(size: int) -> int:
    """What a unary request of `size` bytes takes of the budget while it is served."""
    return REQUEST_COST * size


class ByteBudget:
    """Bytes held by the requests and responses in flight, against `limit` (None: no limit)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.held = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        #: Room set aside at the door for the requests being read.
        self.reading = 0
        #: What the door sets aside for a request about to be read: the most that requests read of late cost.
        #: Until one is read, all of it: the first requests are read one at a time.
        self.expected = limit or 0
        self._learned = False
        self._doors: list[asyncio.Future[None]] = []

    def _fits(self, size: int) -> bool:
        return self.limit is None or self.held == 0 or self.held + size <= self.limit

    def fits(self, size: int) -> bool:
        """Whether a unary request of `size` bytes would be admitted now."""
        return not self._waiting and self._fits(size)

    def refusal(self, size: int, what: str = "this request costs") -> Unavailable:
        """What a request that would take `size` bytes and does not fit is refused with."""
        return Unavailable(
            f"the server holds {_mib(self.held)} of requests and responses in flight and {what} "
            f"{_mib(size)}, which would pass its limit of {_mib(self.limit or 0)} (--max-inflight-mb): "
            "try again"
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

    async def reserve_read(self) -> int:
        """Set room aside to read a unary request whose size is not known yet, or refuse it (`Unavailable`)
        before its message is read where the bytes held leave none. Waits while requests being read took the
        room: their reads end soon, and free it or tell it is taken. Returns the room set aside, for `read`."""
        while not self._room():
            if not self.reading:
                raise self.refusal(self.expected, "requests cost of late")
            future = asyncio.get_running_loop().create_future()
            self._doors.append(future)
            try:
                await future
            finally:
                if not future.done():
                    self._doors.remove(future)
        self.reading += self.expected
        return self.expected

    def _room(self) -> bool:
        if self.limit is None:
            return True
        if self._waiting:
            return False  # streams wait their turn: a unary request does not jump the queue
        if not self._learned:
            # No request read yet tells what one costs: they are read one at a time, whatever else (an HTTP
            # request, a stream) holds bytes within the limit, and the first one read teaches the door.
            return self.reading == 0 and self.held < self.limit
        taken = self.held + self.reading
        return taken == 0 or taken + self.expected <= self.limit

    def read(self, reserved: int, size: int | None) -> None:
        """The request the door let in was read (`size` bytes; None: it never came): the room set aside for it
        goes back, and the door learns what a request costs."""
        self.reading -= reserved
        if size is not None:
            decayed = self.expected - self.expected // FORGET if self._learned else 0
            self.expected, self._learned = max(cost_of(size), decayed), True
        doors, self._doors = self._doors, []
        for future in doors:
            if not future.done():
                future.set_result(None)

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
        self,
        budget: ByteBudget,
        done: asyncio.Queue[tuple[pb.ModelStreamInferResponse, int, asyncio.Semaphore] | None],
        slots: asyncio.Semaphore,
    ) -> None:
        self.budget = budget
        self.done = done
        #: The stream's request slots: a response gives its request's back once sent.
        self.slots = slots
        self.limit = budget.stream_limit()
        self.held = 0
        self._freed = asyncio.Event()

    async def wait_for_room(self) -> None:
        """Wait while the stream holds its share: its responses are not being taken, so read no further."""
        while self.limit is not None and self.held >= self.limit:
            self._freed.clear()
            await self._freed.wait()

    async def take(self, size: int) -> None:
        """A request read: its bytes, once they fit the server's budget."""
        await self.budget.wait(size)
        self.held += size

    def put(
        self, response: pb.ModelStreamInferResponse, size: int = 0, slot: asyncio.Semaphore | None = None
    ) -> None:
        """A response to send; `size`: the bytes of its request that go with it; `slot`: what it gives back
        once sent (its request's slot unless said)."""
        made = response.ByteSize()
        self.budget.charge(made)
        self.held += made
        self.done.put_nowait((response, size + made, slot or self.slots))

    def free(self, size: int) -> None:
        """Bytes sent, or of a request that will send nothing."""
        self.held -= size
        self.budget.release(size)
        self._freed.set()

    def close(self) -> None:
        """The stream ended: everything it still holds goes back."""
        self.budget.release(self.held)
        self.held = 0


class ModelShares:
    """What the requests of each model hold of one connection: how many are being served and their bytes,
    each model within its share (`MODEL_SHARE`) of the connection's requests and of the server's budget."""

    __slots__ = ("_held", "_max_bytes")

    def __init__(self, budget: ByteBudget) -> None:
        #: Per model: its requests being served and their bytes.
        self._held: dict[str, list[int]] = {}
        self._max_bytes = None if budget.limit is None else max(1, budget.limit // MODEL_SHARE)

    #: The most requests of one model a connection serves at once.
    max_requests = CONNECTION_INFLIGHT // MODEL_SHARE

    def take(self, model: str, size: int) -> None:
        """Count a request of `model` of `size` bytes, or refuse it (`Unavailable`) where its model holds its
        share already. A model that holds nothing is never refused (its request is within the message limit)."""
        held = self._held.get(model)
        if held is None:
            self._held[model] = [1, size]
            return
        count, taken = held
        if count >= self.max_requests or (self._max_bytes is not None and taken + size > self._max_bytes):
            most = f"{self.max_requests} requests" + (
                "" if self._max_bytes is None else f" and {_mib(self._max_bytes)}"
            )
            raise Unavailable(
                f"model '{model}' has {count} requests ({_mib(taken)}) being served on this connection, its "
                f"share of what the connection holds (at most {most}): try again once they are answered"
            )
        held[0] += 1
        held[1] += size

    def free(self, model: str, size: int) -> None:
        """A request of `model` taken with `size` bytes is answered."""
        held = self._held[model]
        held[0] -= 1
        held[1] -= size
        if not held[0]:
            del self._held[model]

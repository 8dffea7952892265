"""Requests sent on one long-lived connection, their responses matched by `id`.

The caller's deadline and trace context travel in each request's parameters (`pipeline.protocol.streams`),
and a failure comes back as the `grpc.aio.AioRpcError` a unary call would have raised, with the same status
details, so retries and error mapping do not know the difference. A request whose caller stops waiting for
it (its own caller went away) is cancelled at the server too, as a unary call's cancellation would be
(`_stop`): its model's instance, and the calls the model made, are freed down the chain. One whose deadline
passes is left to the server, which has the deadline too and answers as for a request out of time.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
from collections.abc import Mapping, Sequence

import grpc
from grpc_status import rpc_status

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.sequence_line import in_line
from pipeline.protocol.sequences import SEQUENCE_ID
from pipeline.protocol.streams import add_hop_parameters, remove_hop_parameters, status_of

_CODES = {code.value[0]: code for code in grpc.StatusCode}

#: A request given up this close to its deadline (or past it) is not cancelled at the server: its caller's
#: deadline passed, and the server's copy of it ends the request a moment later, as out of time.
DEADLINE_MARGIN_S = 0.05


def rpc_error(
    code: grpc.StatusCode, details: str, trailing: Sequence[tuple[str, str | bytes]] = ()
) -> grpc.aio.AioRpcError:
    """The error a unary call with this outcome would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class ConnectionRecycled(grpc.aio.AioRpcError):
    """A request cut off by the end of the connection that carried it (a gRPC stream or a frame connection),
    not refused by the server: most often the connection was recycled (`max_connection_age`) or the server
    went away. The server may or may not have run the request; no answer came. Sent again, it travels on a
    new connection. Whichever transport carried the call, this is how its end is reported (UNAVAILABLE)."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def raise_streamed_error(response: pb.ModelStreamInferResponse) -> None:
    """Raise what a unary call would have raised, where a streamed response says its request failed."""
    if response.error_message:
        status = status_of(response)
        code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
        raise rpc_error(code, status.message, rpc_status.to_status(status).trailing_metadata)


class MatchedRequests(abc.ABC):
    """Requests sent on one connection and their responses matched by `id`: what a gRPC stream and a frame
    connection share. A subclass sends (`_send`) and reads, handing each response to `_answered`."""

    #: What the ids of this kind of connection begin with (in logs, which hop a request took).
    PREFIX = ""
    #: Whether requests written in turn reach the server in that order (`in_line`): a frame connection lasts
    #: as long as the server, while a gRPC stream is replaced at its age, and a request written on the next
    #: one may overtake one on the last.
    KEEPS_ORDER = False

    def __init__(self) -> None:
        self._pending: dict[str, asyncio.Future[pb.ModelStreamInferResponse]] = {}
        self._ids = itertools.count()
        self.broken: grpc.aio.AioRpcError | None = None

    @abc.abstractmethod
    async def _send(self, request: pb.ModelInferRequest) -> None:
        """Write `request` on the connection."""

    async def infer(
        self, request: pb.ModelInferRequest, timeout: float | None, trace: Mapping[str, str]
    ) -> pb.ModelInferResponse:
        """Send `request` and wait for its response (at most `timeout` seconds); raises `AioRpcError` as a
        unary call would. The request's `id` is the connection's while it travels."""
        if self.broken is not None:
            raise self.broken
        own_id = request.id
        key = request.id = f"{self.PREFIX}{next(self._ids)}"
        add_hop_parameters(request, timeout, trace)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[pb.ModelStreamInferResponse] = loop.create_future()
        self._pending[key] = future
        timer = loop.call_later(timeout, self._expire, key) if timeout is not None else None
        try:
            await self._send(request)
            if self.KEEPS_ORDER and SEQUENCE_ID in request.parameters:
                in_line()  # written in turn: the stream's next request of its sequence may go
            response = await future
        except asyncio.CancelledError:
            if self._pending.pop(key, None) is not None and (
                timer is None or timer.when() - loop.time() > DEADLINE_MARGIN_S
            ):
                self._stop(key)
            raise
        finally:
            self._pending.pop(key, None)
            if timer is not None:
                timer.cancel()
            request.id = own_id
            remove_hop_parameters(request)
            self._settled()
        raise_streamed_error(response)
        reply = response.infer_response
        reply.id = own_id
        return reply

    def _settled(self) -> None:
        """A request has left (answered, failed or given up on): a subclass may close an idle connection."""
        return None

    def _stop(self, key: str) -> None:
        """The caller no longer waits for the request sent as `key` (it may not have gone yet): a subclass
        tells the server to stop it, where it can."""
        return None

    def _expire(self, key: str) -> None:
        future = self._pending.pop(key, None)
        if future is not None and not future.done():
            future.set_exception(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _answered(self, response: pb.ModelStreamInferResponse) -> None:
        future = self._pending.pop(response.infer_response.id, None)
        if future is not None and not future.done():
            future.set_result(response)

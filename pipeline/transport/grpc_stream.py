"""Calls over one long-lived `ModelStreamInfer` stream instead of one unary call each, and the stream of a
decoupled model's responses.

Python gRPC spends a third as much CPU on a message of a stream as on a unary call (`bench/grpc_floor.py`
measures both), so `ModelInfer` requests go on one stream to a server where its server says
(`STREAM_STATUS_EXTENSION`) that a failed request's response carries its whole status. Requests on a stream
are matched with their responses by `id`, which the stream assigns (`pipeline.transport.matched`).

A stream takes new requests for `MAX_AGE_S`: servers recycle their connections (`max_connection_age`), and a
stream opened afterwards travels on the new connection while the old one finishes what it carries. A stream
without requests for `IDLE_S` is closed, so that a server that stops is not kept waiting for it.

A request its caller stops waiting for is cancelled at the server by a message naming it
(`CANCEL_PARAMETER`); on a stream that takes no more requests, by cancelling the stream once no request on
it is waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.streams import CANCEL_PARAMETER, EMPTY_FINAL_PARAMETER, is_final
from pipeline.transport.matched import ConnectionRecycled, MatchedRequests, rpc_error

log = logging.getLogger(__name__)

#: Seconds a stream takes new requests (see the module docstring).
MAX_AGE_S = 10.0
#: Seconds without requests after which a stream is closed (the next request opens another).
IDLE_S = 0.5


#: How a stream's call ends when its connection does: gRPC's core reports a connection closed under a live
#: call as any of these.
_CUT_OFF = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)


class GrpcStream(MatchedRequests):
    """One `ModelStreamInfer` call to a server, carrying many requests at once."""

    PREFIX = "s"

    def __init__(
        self, stub: pb_grpc.GRPCInferenceServiceStub, metadata: Sequence[tuple[str, str | bytes]]
    ) -> None:
        super().__init__()
        self._call = stub.ModelStreamInfer(metadata=tuple(metadata))
        self._writing = asyncio.Lock()
        self.opened = time.monotonic()
        self._retired = False
        self._idle: asyncio.TimerHandle | None = None
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def fresh(self) -> bool:
        """Whether the stream should take new requests."""
        return self.broken is None and not self._retired and time.monotonic() - self.opened < MAX_AGE_S

    async def _send(self, request: pb.ModelInferRequest) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        async with self._writing:
            try:
                await self._call.write(request)
            except asyncio.InvalidStateError:  # the call ended before this request could go
                raise ConnectionRecycled("the server's stream ended") from None
            except grpc.aio.AioRpcError as err:  # the call failed as a whole: its status
                raise self._broken(err) from None

    def _stop(self, key: str) -> None:
        if self.broken is not None:
            return
        if self._retired:  # done writing, or about to be: only the whole stream can be cancelled
            if not self._pending:
                self._call.cancel()
            return
        cancel = pb.ModelInferRequest(id=key)
        cancel.parameters[CANCEL_PARAMETER].bool_param = True
        task = asyncio.get_running_loop().create_task(self._send_quietly(cancel))
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    async def _send_quietly(self, message: pb.ModelInferRequest) -> None:
        """Write `message` unless the stream has ended meanwhile (its server then stops what it carried)."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            async with self._writing:
                if self.broken is None:
                    await self._call.write(message)

    def _settled(self) -> None:
        if not self._pending and self.broken is None and not self._retired:
            self._idle = asyncio.get_running_loop().call_later(IDLE_S, self._retire)

    def _retire(self) -> None:
        """Close an idle stream: no new request goes on it, and the server ends it once it has answered."""
        self._idle = None
        if self._pending or self.broken is not None or self._retired:
            return
        self._retired = True
        task = asyncio.get_running_loop().create_task(self.close())
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    @staticmethod
    def _broken(err: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
        """What the requests of a stream that failed with `err` fail with: the server's own refusal of the
        whole stream (a credential, an unknown method) as it is, a connection's end as `ConnectionRecycled`."""
        if err.code() in _CUT_OFF:
            return ConnectionRecycled(f"the server's stream ended: {err.details() or err.code().name}")
        return rpc_error(err.code(), err.details() or "the server's stream failed")

    async def _read(self) -> None:
        broken: grpc.aio.AioRpcError = ConnectionRecycled("the server's stream ended")
        try:
            async for response in self._call:
                self._answered(response)
        except grpc.aio.AioRpcError as err:
            broken = self._broken(err)
        except asyncio.CancelledError:
            broken = ConnectionRecycled("the server's stream was closed")
            raise
        finally:
            self.broken = broken
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(
                        ConnectionRecycled(broken.details() or "")
                        if isinstance(broken, ConnectionRecycled)
                        else rpc_error(broken.code(), broken.details() or "")
                    )
            self._pending.clear()

    async def close(self) -> None:
        """Stop sending; the requests in flight still get their responses."""
        self._retired = True
        if self.broken is None:
            try:
                async with self._writing:
                    await self._call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass
        await asyncio.gather(self._reader, return_exceptions=True)

    async def closed(self) -> None:
        """Wait until the stream has ended (the server has answered what it carried, or it broke)."""
        await asyncio.gather(self._reader, return_exceptions=True)

    def cancel(self) -> None:
        """Cut the stream off: its requests in flight fail as UNAVAILABLE."""
        self.broken = self.broken or ConnectionRecycled("the server's stream was closed")
        if self._idle is not None:
            self._idle.cancel()
        self._call.cancel()
        self._reader.cancel()


#: Idle streams being closed, and cancellations being sent (held so that their tasks are not collected
#: before they end).
_closing: set[asyncio.Task[None]] = set()


async def decoupled_responses(
    stub: pb_grpc.GRPCInferenceServiceStub,
    request: pb.ModelInferRequest,
    timeout: float | None,
    metadata: Sequence[tuple[str, str | bytes]],
) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
    """A decoupled model's responses to `request`, in order, up to the one marked final (asked for even when
    it would be empty), on a `ModelStreamInfer` call of its own, so that its flow control is its own: a
    reader that reads slowly holds back only its own model's responses, and closing the iterator early
    cancels the call, which stops the model. An error the model sends comes as a response of its own, a
    failed call raises its `AioRpcError`; the responses end with the final one, or where the stream does."""
    sent = pb.ModelInferRequest()
    sent.CopyFrom(request)
    sent.parameters[EMPTY_FINAL_PARAMETER].bool_param = True
    call = stub.ModelStreamInfer(timeout=timeout, metadata=tuple(metadata))
    try:
        await call.write(sent)
        await call.done_writing()
        async for reply in call:
            yield reply
            if is_final(reply):
                return
    finally:
        call.cancel()

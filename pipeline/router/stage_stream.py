"""Stage calls over a long-lived `ModelStreamInfer` stream instead of one unary call each.

Python gRPC spends a third as much CPU on a message of a stream as on a unary call (`bench/grpc_floor.py`
measures both), so the router sends a stage's `ModelInfer` requests on one stream per replica where the
replica's server says (`STREAM_STATUS_EXTENSION`) that a failed request's response carries its whole
status. Requests on a stream are matched with their responses by `id`, which the stream assigns; the
caller's deadline and trace context travel in the request's parameters (`pipeline.protocol.streams`), and a
failure comes back as the `grpc.aio.AioRpcError` a unary call would have raised, with the same status
details, so retries and error mapping do not know the difference.

A stream is replaced after `MAX_AGE_S`: servers recycle their connections (`max_connection_age`), and a
stream opened afterwards travels on the new connection while the old one finishes what it carries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.transport.matched import MatchedRequests, rpc_error

log = logging.getLogger(__name__)

#: Seconds a stream takes new requests (see the module docstring).
MAX_AGE_S = 10.0


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


class StreamBroken(grpc.aio.AioRpcError):
    """A request cut off by the end of its stream, not refused by the stage: most often the connection
    under the stream was recycled (`max_connection_age`) or the replica went away. The stage may or may not
    have run the request; no answer came. Sent again on a new stream, it travels on a new connection."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class StageStream(MatchedRequests):
    """One `ModelStreamInfer` call to a replica, carrying many requests at once."""

    PREFIX = "s"

    def __init__(
        self, stub: pb_grpc.GRPCInferenceServiceStub, metadata: Sequence[tuple[str, str | bytes]]
    ) -> None:
        super().__init__()
        self._call = stub.ModelStreamInfer(metadata=tuple(metadata))
        self._writing = asyncio.Lock()
        self.opened = time.monotonic()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def fresh(self) -> bool:
        """Whether the stream should take new requests."""
        return self.broken is None and time.monotonic() - self.opened < MAX_AGE_S

    async def _send(self, request: pb.ModelInferRequest) -> None:
        async with self._writing:
            try:
                await self._call.write(request)
            except asyncio.InvalidStateError:  # the call ended before this request could go
                raise StreamBroken("the stage's stream ended") from None
            except grpc.aio.AioRpcError as err:  # the call failed as a whole: its status
                raise self._broken(err) from None

    @staticmethod
    def _broken(err: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
        """What the requests of a stream that failed with `err` fail with: the stage's own refusal of the
        whole stream (a credential, an unknown method) as it is, a connection's end as `StreamBroken`."""
        if err.code() in _CUT_OFF:
            return StreamBroken(f"the stage's stream ended: {err.details() or err.code().name}")
        return rpc_error(err.code(), err.details() or "the stage's stream failed")

    async def _read(self) -> None:
        broken: grpc.aio.AioRpcError = StreamBroken("the stage's stream ended")
        try:
            async for response in self._call:
                self._answered(response)
        except grpc.aio.AioRpcError as err:
            broken = self._broken(err)
        except asyncio.CancelledError:
            broken = StreamBroken("the stage's stream was closed")
            raise
        finally:
            self.broken = broken
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(
                        StreamBroken(broken.details() or "")
                        if isinstance(broken, StreamBroken)
                        else rpc_error(broken.code(), broken.details() or "")
                    )
            self._pending.clear()

    async def close(self) -> None:
        """Stop sending; the requests in flight still get their responses."""
        if self.broken is None:
            try:
                async with self._writing:
                    await self._call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass
        await asyncio.gather(self._reader, return_exceptions=True)

    def cancel(self) -> None:
        """Cut the stream off: its requests in flight fail as UNAVAILABLE."""
        self.broken = self.broken or StreamBroken("the stage's stream was closed")
        self._call.cancel()
        self._reader.cancel()

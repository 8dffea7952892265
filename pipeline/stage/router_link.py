"""The stage service's link to the router, on which the calls its models make to other models go
(`pipeline.stage.bls`). The calls go on one connection to the router's frame port where the router has one
(`pipeline.transport.frame_client`: the protocol's messages without gRPC's cost per message, with the TLS and
token of the gRPC channel), else on one `ModelStreamInfer` stream; calls to decoupled models go on a stream of
their own, and the callees' `max_batch_size` is asked once per model.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.frames import port_of
from pipeline.protocol.streams import EMPTY_FINAL_PARAMETER, add_hop_parameters, is_final
from pipeline.runtime.server import server_options
from pipeline.transport.frame_client import FrameConnection, host_of
from pipeline.transport.matched import raise_streamed_error

log = logging.getLogger(__name__)

#: Seconds before a router's frame port that could not be used is tried again (gRPC carries the calls meanwhile).
FRAMES_RETRY_S = 5.0


class RouterCalls:
    """The service's channel to the router, on which its models' calls go. The router's address is
    `address`, or read from `port_file` (with `host`) at the first call, for a router started after the
    service on a port the OS picked. `credentials` and `tls` (None: plaintext), the gRPC channel's and the
    frame connection's TLS, and `token` (the router's clients' bearer token) go with every call."""

    def __init__(
        self,
        address: str | None,
        *,
        port_file: Path | None = None,
        host: str = "127.0.0.1",
        max_message_bytes: int = 64 * 1024 * 1024,
        credentials: grpc.ChannelCredentials | None = None,
        tls: ssl.SSLContext | None = None,
        token: str | None = None,
    ) -> None:
        self._credentials = credentials
        self._tls = tls
        self._resolved: str | None = None
        #: The frame connection, once open; when the router's frame port was last found unusable.
        self._frames: FrameConnection | None = None
        self._frames_failed_at: float | None = None
        self._opening: asyncio.Task[FrameConnection | None] | None = None
        self._address = address
        self._port_file = port_file
        self._host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        self._max_message_bytes = max_message_bytes
        self._auth = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GRPCInferenceServiceStub | None = None
        self._shared: _SharedStream | None = None
        self._batch_sizes: dict[str, asyncio.Task[int]] = {}

    @property
    def configured(self) -> bool:
        return self._address is not None or self._port_file is not None

    def _connect(self) -> pb_grpc.GRPCInferenceServiceStub:
        if self._stub is not None:
            return self._stub
        address = self._address
        if address is None and self._port_file is not None:
            try:
                address = f"{self._host}:{int(self._port_file.read_text().strip())}"
            except (OSError, ValueError) as exc:
                raise ConnectionError(
                    f"cannot read the router's port from {self._port_file}: {exc}"
                ) from None
        if address is None:
            raise ConnectionError("no router address")
        self._resolved = address
        options = server_options(self._max_message_bytes)
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(address, self._credentials, options=options)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def infer(
        self, request: pb.ModelInferRequest, timeout: float | None, context: Mapping[str, str]
    ) -> pb.ModelInferResponse:
        """One call, on the frame connection or else the stream that carries the service's calls (one for
        them all: a message on it costs the router and the service less than a call of its own); `context`
        is the call's trace context and chain. A call that fails raises the `grpc.aio.AioRpcError` a unary
        call would have raised."""
        frames = self._frames
        if frames is None or frames.broken is not None:
            frames = await self._frame_connection()
        if frames is not None:
            return await frames.infer(request, timeout, context)
        stream = self._shared
        if stream is None or stream.broken:
            stream = self._shared = _SharedStream(self._connect(), self._auth)
        reply = await stream.infer(request, timeout, context)
        raise_streamed_error(reply)
        return reply.infer_response

    async def _frame_connection(self) -> FrameConnection | None:
        """The frame connection to the router, opened where the router names a frame port; None (gRPC then)
        where it names none, or where it could not be used in the last `FRAMES_RETRY_S` seconds. One
        opening at a time: the calls made meanwhile wait for it."""
        failed = self._frames_failed_at
        if failed is not None and time.monotonic() - failed < FRAMES_RETRY_S:
            return None
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open_frames())
        opening = self._opening
        try:
            return await asyncio.shield(opening)
        finally:
            if opening.done() and self._opening is opening:
                self._opening = None

    async def _open_frames(self) -> FrameConnection | None:
        stub = self._connect()
        try:
            metadata = await stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=5.0, metadata=self._auth)
            port = port_of(tuple(metadata.extensions))
            if port is None:
                self._frames_failed_at = time.monotonic()
                return None
            assert self._resolved is not None
            host = host_of(self._resolved) or self._host
            self._frames = await FrameConnection.open(
                host, port, self._auth, self._max_message_bytes, tls=self._tls
            )
        except (grpc.aio.AioRpcError, OSError, TimeoutError) as err:
            log.warning(
                "the router's frame port cannot be used (%s): models' calls go over gRPC for %.0f s",
                err,
                FRAMES_RETRY_S,
            )
            self._frames_failed_at = time.monotonic()
            return None
        self._frames_failed_at = None
        log.info("models' calls to other models go to the router's frame port %s:%d", host, port)
        return self._frames

    async def stream(
        self, request: pb.ModelInferRequest, timeout: float | None, metadata: Sequence[tuple[str, str]]
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """A decoupled model's responses, up to the final one (asked for even when empty)."""
        request.parameters[EMPTY_FINAL_PARAMETER].bool_param = True
        call = self._connect().ModelStreamInfer(timeout=timeout, metadata=(*metadata, *self._auth))
        try:
            await call.write(request)
            await call.done_writing()
            async for reply in call:
                yield reply
                if is_final(reply):
                    return
        finally:
            call.cancel()

    async def max_batch_size(self, model: str) -> int:
        """The callee's `max_batch_size` as the router's `ModelConfig` says (0: it does not batch, or the
        router cannot say now), asked once per model."""
        known = self._batch_sizes.get(model)
        if known is None:
            known = self._batch_sizes[model] = asyncio.ensure_future(self._ask_batch_size(model))
        return await asyncio.shield(known)

    async def _ask_batch_size(self, model: str) -> int:
        try:
            reply = await self._connect().ModelConfig(
                pb.ModelConfigRequest(name=model), timeout=5.0, metadata=self._auth
            )
        except (grpc.aio.AioRpcError, ConnectionError):
            del self._batch_sizes[model]  # asked again by the next call
            return 0
        return int(reply.config.max_batch_size)

    async def close(self) -> None:
        if self._frames is not None:
            self._frames.close()
        if self._shared is not None:
            self._shared.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


class _SharedStream:
    """One `ModelStreamInfer` call to the router that carries many requests at once, each answered by its
    id. Its deadline, trace context and chain travel in each request's parameters, as the router's own
    streams to its stages carry them (`pipeline.protocol.streams`). A call whose caller stops waiting
    (cancelled, or past its deadline) is forgotten here; the router finishes it. Once the stream ends, every
    call on it is answered UNAVAILABLE, and the next call opens a new one. A stream without calls for
    `IDLE_S` is closed, so that a stopping router is not kept waiting for it."""

    #: Seconds without calls after which the stream is closed (the next call opens another).
    IDLE_S = 0.5

    def __init__(self, stub: pb_grpc.GRPCInferenceServiceStub, auth: Sequence[tuple[str, str]]) -> None:
        self._call = stub.ModelStreamInfer(metadata=tuple(auth))
        self._waiting: dict[str, asyncio.Future[pb.ModelStreamInferResponse]] = {}
        self._writing = asyncio.Lock()
        self._ids = itertools.count()
        self.broken = False
        self._idle: asyncio.TimerHandle | None = None
        self._reader = asyncio.create_task(self._read())

    async def infer(
        self, request: pb.ModelInferRequest, timeout: float | None, context: Mapping[str, str]
    ) -> pb.ModelStreamInferResponse:
        key = f"{next(self._ids)}"
        request.id = f"{request.id}#{key}" if request.id else key
        add_hop_parameters(request, timeout, context)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[pb.ModelStreamInferResponse] = loop.create_future()
        self._waiting[request.id] = answer
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        try:
            async with asyncio.timeout(timeout):
                async with self._writing:  # NOTE: one write at a time on a stream
                    await self._call.write(request)
                return await answer
        except TimeoutError:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "Deadline Exceeded",
            ) from None
        finally:
            self._waiting.pop(request.id, None)
            if not self._waiting and not self.broken:
                self._idle = loop.call_later(self.IDLE_S, self._retire)

    def _retire(self) -> None:
        """Close an idle stream: no new call goes on it, and the router ends it once it has answered."""
        if self._waiting or self.broken:
            return
        self.broken = True
        self._done = asyncio.ensure_future(self._call.done_writing())

    async def _read(self) -> None:
        status, details = grpc.StatusCode.UNAVAILABLE, "the stream to the router ended"
        try:
            async for reply in self._call:
                answer = self._waiting.get(reply.infer_response.id)
                if answer is not None and not answer.done():
                    answer.set_result(reply)
        except grpc.aio.AioRpcError as err:
            status, details = err.code(), err.details() or details
        except asyncio.CancelledError:
            pass
        finally:
            self.broken = True
            for answer in self._waiting.values():
                if not answer.done():
                    answer.set_exception(
                        grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
                    )

    def close(self) -> None:
        self.broken = True
        if self._idle is not None:
            self._idle.cancel()
        self._call.cancel()
        self._reader.cancel()

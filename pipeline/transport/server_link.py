"""How this process calls one server that speaks the protocol: its gRPC stub for every RPC, and for
`ModelInfer` the cheapest way that server offers, chosen here and nowhere else.

A call whose metadata is only this process's own (its token and the call's trace context and chain, which
travel in the request's parameters) goes, in order of preference:
1. to the server's frame port (`pipeline.transport.frame_client`), where `ServerMetadata.extensions` names one
   (`pipeline.protocol.frames.port_of`) and it can be reached: with the TLS and token of the gRPC channel,
   never plaintext under a TLS channel;
2. else on one shared `ModelStreamInfer` stream (`pipeline.transport.grpc_stream`), where the server says a
   failed streamed request's response carries its whole status (`STREAM_STATUS_EXTENSION`);
3. else, and for a call that carries a client's own metadata, as a unary `ModelInfer` call.

All three fail alike: the `grpc.aio.AioRpcError` a unary call would have raised, with the same status
details, so a caller's retries and error mapping do not know which one carried the call. A decoupled
model's responses always come on a call of their own (`decoupled_responses`).

What the server offers is asked once; `forget` asks it afresh (the server went away, and what comes back
may be another). A frame port that could not be used is tried again after `FRAMES_RETRY_S`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import AsyncGenerator, Sequence

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.frames import port_of
from pipeline.protocol.streams import STREAM_STATUS_EXTENSION, TRACE_PARAMETERS
from pipeline.transport.frame_client import FrameConnection, host_of
from pipeline.transport.grpc_stream import GrpcStream, decoupled_responses
from pipeline.transport.matched import MatchedRequests

log = logging.getLogger(__name__)

#: Seconds before a frame port that could not be used is tried again (the other ways carry the calls).
FRAMES_RETRY_S = 5.0

Metadata = Sequence[tuple[str, str | bytes]]


class ServerLink:
    """One server's address and channel, and the transport of the `ModelInfer` calls sent to it."""

    def __init__(
        self,
        address: str,
        channel: grpc.aio.Channel,
        auth: Metadata,
        max_frame_bytes: int,
        *,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        """`auth`: this process's own credentials (its token's metadata), sent with every call; `tls` and
        `server_name`: the TLS of the frame connection, that of `channel` (None: plaintext)."""
        self.address = address
        self.stub = pb_grpc.GRPCInferenceServiceStub(channel)
        self._auth = tuple(auth)
        self._max_frame_bytes = max_frame_bytes
        self._tls, self._server_name = tls, server_name
        #: The server's `ServerMetadata.extensions` (None: not asked yet).
        self.extensions: frozenset[str] | None = None
        self._frames: FrameConnection | None = None
        #: When its frame port was last found unusable (None: never, or it has none).
        self._frames_failed_at: float | None = None
        self._connecting: asyncio.Task[FrameConnection | None] | None = None
        self._stream: GrpcStream | None = None
        self._retiring: set[asyncio.Task[None]] = set()

    @property
    def transport(self) -> str:
        """How its calls travel now, for logs and tests: `frames`, `stream`, `unary` or `unknown`."""
        if self._frames is not None and self._frames.usable:
            return "frames"
        if self.extensions is None:
            return "unknown"
        return "stream" if STREAM_STATUS_EXTENSION in self.extensions else "unary"

    async def infer(
        self, request: pb.ModelInferRequest, timeout: float | None, metadata: Metadata
    ) -> pb.ModelInferResponse:
        """One `ModelInfer` call within `timeout`, on the transport the module docstring describes.
        `metadata` holds this process's credentials, the call's trace context and chain, and any of a
        client's own (which needs a unary call)."""
        trace = {key: str(value) for key, value in metadata if key in TRACE_PARAMETERS}
        if len(trace) + len(self._auth) == len(metadata):
            matched = await self._matched()
            if matched is not None:
                return await matched.infer(request, timeout, trace)
        return await self.stub.ModelInfer(request, timeout=timeout, metadata=metadata)

    def decoupled(
        self, request: pb.ModelInferRequest, timeout: float | None, metadata: Metadata
    ) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
        """A decoupled model's responses to `request`, up to the final one (`decoupled_responses`)."""
        return decoupled_responses(self.stub, request, timeout, (*metadata, *self._auth))

    async def _matched(self) -> MatchedRequests | None:
        frames = self._frames
        if frames is not None and frames.usable:
            return frames
        frames = await self.frame_connection()
        if frames is not None:
            return frames
        return await self.shared_stream()

    async def _offers(self) -> frozenset[str] | None:
        """The server's extensions, asked once (None where it cannot say now: asked again next time)."""
        if self.extensions is None:
            try:
                meta = await self.stub.ServerMetadata(
                    pb.ServerMetadataRequest(), timeout=2.0, metadata=self._auth
                )
            except grpc.aio.AioRpcError:
                return None
            self.extensions = frozenset(meta.extensions)
        return self.extensions

    async def frame_connection(self) -> FrameConnection | None:
        """The connection to the server's frame port, opened on first use; None where it has none, or where
        it could not be used in the last `FRAMES_RETRY_S` seconds. One opening at a time: the calls made
        meanwhile wait for it."""
        failed = self._frames_failed_at
        if failed is not None and time.monotonic() - failed < FRAMES_RETRY_S:
            return None
        if self.extensions is not None and port_of(self.extensions) is None:
            return None
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open_frames())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open_frames(self) -> FrameConnection | None:
        extensions = await self._offers()
        port = port_of(extensions) if extensions is not None else None
        host = host_of(self.address)
        if port is None or host is None:
            return None
        try:
            frames = await FrameConnection.open(
                host, port, self._auth, self._max_frame_bytes, tls=self._tls, server_name=self._server_name
            )
        except (OSError, TimeoutError) as err:
            self._frames_failed_at = time.monotonic()
            log.info(
                "%s: calls over gRPC for %.0f s (its frame port %d: %s)",
                self.address,
                FRAMES_RETRY_S,
                port,
                err,
            )
            return None
        if self._frames_failed_at is None:
            log.info("%s: calls over its frame port %d", self.address, port)
        self._frames, self._frames_failed_at = frames, None
        return frames

    async def shared_stream(self) -> GrpcStream | None:
        """The stream its `ModelInfer` calls travel on, or None where its server takes unary calls only."""
        extensions = await self._offers()
        if extensions is None or STREAM_STATUS_EXTENSION not in extensions:
            return None
        current = self._stream
        if current is None or not current.fresh:
            if current is not None:
                self._retire(current)
            current = self._stream = GrpcStream(self.stub, self._auth)
        return current

    def _retire(self, stream: GrpcStream) -> None:
        """Let a stream finish what it carries, in the background."""
        task = asyncio.get_running_loop().create_task(stream.close())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def forget(self) -> None:
        """The server went away: when it is back (perhaps restarted, perhaps another server), ask it afresh
        how it takes calls."""
        self.extensions, self._frames_failed_at = None, None

    def close(self) -> None:
        """Cut its frame connection and stream off (the channel is closing): calls in flight on them fail as
        UNAVAILABLE."""
        if self._frames is not None:
            self._frames.close()
            self._frames = None
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        if self._connecting is not None:
            self._connecting.cancel()
        for task in self._retiring:
            task.cancel()

"""A connection to a server's frame port (`pipeline.protocol.frames`): many `ModelInfer` requests in flight on
one stream, matched with their responses by `id`; over TLS where the caller's gRPC channel to that server has
TLS (the same roots, client certificate and server name), never plaintext then. The router calls its stages
this way, and the stages send their models' calls (BLS) to the router this way.

It behaves as a `ModelStreamInfer` stream does (`pipeline.transport.matched`), down to the errors: a failed
request raises the `grpc.aio.AioRpcError` a unary call would have raised, with the same status details, and
a connection that breaks fails what it carried with `ConnectionRecycled` (UNAVAILABLE), as a stream's end
does, so retries and error mapping do not know the difference. A request its caller stops waiting for is
cancelled at the server with a `CANCEL` frame, where the server takes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Sequence

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.frames import (
    AUTHORIZATION,
    CANCEL,
    CANCELS_PARAMETER,
    HELLO,
    REQUEST,
    RESPONSE,
    parse,
)
from pipeline.transport.frame_protocol import FrameProtocol
from pipeline.transport.matched import ConnectionRecycled, MatchedRequests

log = logging.getLogger(__name__)

#: Seconds to wait for a frame port to accept a connection before calling it unusable.
CONNECT_TIMEOUT_S = 2.0


class FrameConnection(MatchedRequests):
    """One connection to a server's frame port."""

    PREFIX = "f"
    KEEPS_ORDER = True

    def __init__(self, frames: FrameProtocol, *, cancels: bool = False) -> None:
        """`cancels`: whether the server takes `CANCEL` frames (its answer to the hello says so)."""
        super().__init__()
        self._frames = frames
        self._cancels = cancels
        self._reason: str | None = None
        frames.deliver_to(self._response, self._ended)

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        auth: Sequence[tuple[str, str | bytes]],
        max_frame_bytes: int,
        *,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> FrameConnection:
        """Connect (with `tls`, verifying that the server's certificate names `server_name`, else `host`) and
        say hello (with the caller's token, where it has one); raises `OSError` (an `ssl.SSLError` where the
        TLS handshake fails, a `ConnectionError` where the port refuses the hello) or `TimeoutError` where it
        cannot be used."""
        loop = asyncio.get_running_loop()
        name = (server_name or host) if tls is not None else None
        _, frames = await asyncio.wait_for(
            loop.create_connection(
                lambda: FrameProtocol(max_frame_bytes), host, port, ssl=tls, server_hostname=name
            ),
            CONNECT_TIMEOUT_S,
        )
        hello = pb.ModelInferRequest(id="hello")
        for key, value in auth:
            if key == AUTHORIZATION:
                hello.parameters[AUTHORIZATION].string_param = str(value)
        try:
            frames.write(HELLO, hello.SerializeToString())
            kind, payload = await asyncio.wait_for(frames.read(), CONNECT_TIMEOUT_S)
            if kind != RESPONSE:
                raise ConnectionError(f"the frame port answered its hello with a frame of kind {kind}")
            answer = parse(pb.ModelStreamInferResponse, payload)
        except (EOFError, TimeoutError) as err:
            frames.close()
            raise ConnectionError(f"the frame port did not answer its hello: {err!r}") from None
        except ConnectionError:
            frames.close()
            raise
        if answer.error_message:
            frames.close()
            raise ConnectionError(f"the frame port refused its hello: {answer.error_message}")
        cancels = answer.infer_response.parameters.get(CANCELS_PARAMETER)
        return cls(frames, cancels=cancels is not None and cancels.bool_param)

    @property
    def usable(self) -> bool:
        return self.broken is None

    async def _send(self, request: pb.ModelInferRequest) -> None:
        frames = self._frames
        try:
            frames.write(REQUEST, request.SerializeToString())
            await frames.drain()
        except ConnectionError:
            raise ConnectionRecycled(self._reason or "the frame connection ended") from None

    def _stop(self, key: str) -> None:
        if self._cancels and self.broken is None:
            with contextlib.suppress(ConnectionError):  # closing: the server stops what it carried
                self._frames.write(CANCEL, key.encode())

    def _response(self, kind: int, payload: bytearray) -> None:
        if kind != RESPONSE:
            self._ended(ConnectionError(f"the server sent an unexpected frame (kind {kind})"))
            self._frames.close()
            return
        self._answered(parse(pb.ModelStreamInferResponse, payload))

    def _ended(self, reason: Exception) -> None:
        if self.broken is not None:
            return
        ending = "the frame connection ended"
        self._reason = details = f"{ending}: {reason}" if str(reason) else ending
        self.broken = ConnectionRecycled(details)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionRecycled(details))
        self._pending.clear()
        self._frames.close()

    def close(self) -> None:
        """Close the connection: requests in flight fail as UNAVAILABLE."""
        self._frames.close()


def host_of(address: str) -> str | None:
    """The host of a server's `ip:port` or `[ip6]:port` address, with or without its `ipv4:`/`ipv6:` scheme
    (the router's fixed targets keep it); None for a Unix socket."""
    if address.startswith(("unix:", "unix-abstract:")):
        return None
    address = address.removeprefix("ipv4:").removeprefix("ipv6:")
    if address.startswith("["):
        return address[1:].partition("]")[0]
    return address.rpartition(":")[0] or None

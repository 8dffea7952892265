"""The router's connection to a stage's frame port (`pipeline.protocol.frames`): many `ModelInfer`
requests in flight on one plain stream, matched with their responses by `id`.

It behaves as `pipeline.router.stage_stream.StageStream` does, down to the errors: a failed request
raises the `grpc.aio.AioRpcError` a unary call would have raised, with the same status details, and a
connection that breaks fails what it carried as UNAVAILABLE, so retries and error mapping do not know the
difference.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.frames import AUTHORIZATION, HEADER, HELLO, REQUEST, RESPONSE, frame
from pipeline.router.stage_stream import MatchedRequests, rpc_error

log = logging.getLogger(__name__)

#: Seconds to wait for a frame port to accept a connection before calling it unusable.
CONNECT_TIMEOUT_S = 2.0


class FrameConnection(MatchedRequests):
    """One connection to a replica's frame port."""

    PREFIX = "f"

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame_bytes: int
    ) -> None:
        super().__init__()
        self._reader, self._writer = reader, writer
        self._max_frame_bytes = max_frame_bytes
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(
        cls, host: str, port: int, auth: Sequence[tuple[str, str | bytes]], max_frame_bytes: int
    ) -> FrameConnection:
        """Connect and say hello (with the router's token, where it has one); raises `OSError` (a
        `ConnectionError` where the port refuses the hello) or `TimeoutError` where it cannot be used."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=1 << 20), CONNECT_TIMEOUT_S
        )
        hello = pb.ModelInferRequest(id="hello")
        for key, value in auth:
            if key == AUTHORIZATION:
                hello.parameters[AUTHORIZATION].string_param = str(value)
        writer.write(frame(HELLO, hello.SerializeToString()))
        try:
            length, kind = HEADER.unpack(
                await asyncio.wait_for(reader.readexactly(HEADER.size), CONNECT_TIMEOUT_S)
            )
            if kind != RESPONSE or length > max_frame_bytes:
                raise ConnectionError(f"the frame port answered its hello with a frame of kind {kind}")
            answer = pb.ModelStreamInferResponse.FromString(await reader.readexactly(length))
        except (asyncio.IncompleteReadError, TimeoutError) as err:
            writer.close()
            raise ConnectionError(f"the frame port did not answer its hello: {err!r}") from None
        if answer.error_message:
            writer.close()
            raise ConnectionError(f"the frame port refused its hello: {answer.error_message}")
        return cls(reader, writer, max_frame_bytes)

    @property
    def usable(self) -> bool:
        return self.broken is None

    async def _send(self, request: pb.ModelInferRequest) -> None:
        self._writer.write(frame(REQUEST, request.SerializeToString()))
        if self._writer.transport.get_write_buffer_size() > 1 << 20:
            await self._writer.drain()

    async def _read(self) -> None:
        reason = "the stage's frame connection ended"
        try:
            while True:
                length, kind = HEADER.unpack(await self._reader.readexactly(HEADER.size))
                if kind != RESPONSE or length > self._max_frame_bytes:
                    reason = f"the stage sent an unexpected frame (kind {kind}, {length} bytes)"
                    break
                self._answered(pb.ModelStreamInferResponse.FromString(await self._reader.readexactly(length)))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as err:
            reason = f"the stage's frame connection ended: {err}"
        finally:
            self.broken = rpc_error(grpc.StatusCode.UNAVAILABLE, reason)
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(rpc_error(grpc.StatusCode.UNAVAILABLE, reason))
            self._pending.clear()
            self._writer.close()

    def close(self) -> None:
        """Close the connection: requests in flight fail as UNAVAILABLE."""
        self._task.cancel()
        self._writer.close()

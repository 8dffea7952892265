"""The frame protocol's reader and writer on both event loops the services run on (asyncio's and uvloop,
whose transports are not asyncio's classes): frames of every size around its read buffer come back whole and
in order, a frame over the limit and a connection cut inside a frame end it with the reason, a peer that
half-closes still gets its answers, a reader that stops reading stops the connection being read, and a lone
frame leaves at once while those written after it in the same turn of the loop leave together (and, after a
turn of several, those of the next turn from its first on)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.frames import FRONT_BATCH_PARAMETER, HEADER, int64_parameter, stream_response
from pipeline.transport.frame_protocol import READ_AHEAD, FrameProtocol

LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}
SIZES = (0, 1, 4, 5, 100, 65_530, 65_536, 65_541, 200_000, 3 << 20)


async def _echo_pair(
    max_frame_bytes: int = 8 << 20,
) -> tuple[FrameProtocol, asyncio.Task[None], asyncio.Server]:
    """A server that answers every frame with its payload (kind + 1) until the caller ends, and a client."""
    loop = asyncio.get_running_loop()
    served: list[asyncio.Task[None]] = []

    async def echo(frames: FrameProtocol) -> None:
        try:
            while True:
                kind, payload = await frames.read()
                frames.write(kind + 1, bytes(payload))
                await frames.drain()
        except EOFError:
            frames.close()

    class Echo(FrameProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            served.append(loop.create_task(echo(self)))

    server = await loop.create_server(lambda: Echo(max_frame_bytes), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, client = await loop.create_connection(lambda: FrameProtocol(max_frame_bytes), "127.0.0.1", port)
    while not served:
        await asyncio.sleep(0)
    return client, served[0], server


@pytest.mark.parametrize("loop", LOOPS)
def test_frames_of_every_size_come_back_whole_and_in_order(loop: str) -> None:
    async def main() -> None:
        client, served, server = await _echo_pair()
        sent = [(i % 200, bytes([i % 251]) * size) for i, size in enumerate(SIZES * 3)]
        for kind, payload in sent:  # all written before any is read: frames share reads
            client.write(kind, payload)
        for kind, payload in sent:
            got_kind, got = await client.read()
            assert (got_kind, bytes(got)) == (kind + 1, payload)
        client.transport.write_eof()
        await served
        with pytest.raises(EOFError):
            await client.read()
        server.close()

    LOOPS[loop](main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_frame_over_the_limit_ends_the_connection_with_the_reason(loop: str) -> None:
    async def main() -> None:
        client, served, server = await _echo_pair(max_frame_bytes=1000)
        client.write(1, b"x" * 1000)
        assert bytes((await client.read())[1]) == b"x" * 1000
        client.write(1, b"x" * 1001)
        with pytest.raises(ConnectionError, match="a frame of 1001 bytes, more than 1000"):
            await served
        with pytest.raises((EOFError, ConnectionError)):  # the server cut it off
            await client.read()
        server.close()

    LOOPS[loop](main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_cut_inside_a_frame_says_so(loop: str) -> None:
    async def main() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        accepted: asyncio.Future[socket.socket] = asyncio.get_running_loop().run_in_executor(
            None, lambda: listener.accept()[0]
        )
        _, client = await asyncio.get_running_loop().create_connection(
            lambda: FrameProtocol(1 << 20), "127.0.0.1", port
        )
        peer = await accepted
        peer.sendall(HEADER.pack(10, 3) + b"12345")  # half a payload, then the end
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError, match="inside a frame"):
            await client.read()
        peer.close()
        listener.close()
        client.close()

    LOOPS[loop](main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_reader_that_stops_reading_stops_the_connection_being_read(loop: str) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[FrameProtocol] = loop.create_future()

        class Held(FrameProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                super().connection_made(transport)
                accepted.set_result(self)

        server = await loop.create_server(lambda: Held(1 << 20), "127.0.0.1", 0)
        _, client = await loop.create_connection(
            lambda: FrameProtocol(1 << 20), "127.0.0.1", server.sockets[0].getsockname()[1]
        )
        held = await accepted
        frame = b"x" * (256 << 10)
        written = 0
        # Nothing is read on the server's side: the client's writes back up once the server stops reading
        # (READ_AHEAD) and both sockets' buffers are full.
        while client._writable is None:
            client.write(2, frame)
            written += len(frame)
            await asyncio.sleep(0)  # let both ends move bytes
            assert written < 64 * READ_AHEAD, "the server read on while nothing read what it had received"
        assert held._paused and READ_AHEAD < held._unread < 2 * READ_AHEAD + len(frame)
        for _ in range(written // len(frame)):  # reading resumes it: every frame arrives
            assert bytes((await held.read())[1]) == frame
        await client.drain()
        client.close()
        server.close()

    LOOPS[loop](main())


class _Recorded(asyncio.Transport):
    """A transport that keeps what each `writelines` call was given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bytes] = []

    def writelines(self, list_of_data: Any) -> None:
        self.calls.append(b"".join(list_of_data))

    def is_closing(self) -> bool:
        return False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


@pytest.mark.parametrize("loop", LOOPS)
def test_a_lone_frame_leaves_at_once_and_those_after_it_in_the_same_turn_together(loop: str) -> None:
    async def main() -> None:
        frames = FrameProtocol(1 << 20)
        transport = _Recorded()
        frames.connection_made(transport)
        frames.write(2, b"first")
        # Handed to the transport before the loop turns: a lone request's hop waits for nothing else.
        assert transport.calls == [HEADER.pack(5, 2) + b"first"]
        frames.write(3, b"sec", b"ond")
        frames.write(4, b"third")
        assert len(transport.calls) == 1
        await asyncio.sleep(0)  # the end of the turn: the two that followed go in one call
        assert transport.calls[1:] == [HEADER.pack(6, 3) + b"second" + HEADER.pack(5, 4) + b"third"]
        # After a turn of several frames (a load's batches), the next turn gathers from its first frame on.
        frames.write(2, b"gathered")
        assert len(transport.calls) == 2
        await asyncio.sleep(0)
        assert transport.calls[2:] == [HEADER.pack(8, 2) + b"gathered"]
        frames.write(2, b"again")  # after a turn of one frame, the first leaves at once again
        assert transport.calls[3:] == [HEADER.pack(5, 2) + b"again"]

    LOOPS[loop](main())


def test_a_stream_response_in_two_pieces_is_the_message_protobuf_writes() -> None:
    for size in (0, 1, 127, 128, 16_383, 16_384, 3 << 20):  # the length's varint of one to four bytes
        reply = pb.ModelInferResponse(model_name="m", id="7", raw_output_contents=[b"\x01" * size])
        expected = pb.ModelStreamInferResponse(infer_response=reply).SerializeToString()
        assert b"".join(stream_response(reply)) == expected


def test_a_parameter_appended_to_a_stream_response_is_merged_into_its_reply() -> None:
    reply = pb.ModelInferResponse(model_name="m", id="7", raw_output_contents=[b"\x01" * 300])
    reply.parameters["kept"].bool_param = True
    sent = pb.ModelStreamInferResponse.FromString(
        b"".join(stream_response(reply, int64_parameter(FRONT_BATCH_PARAMETER, 48)))
    )
    expected = pb.ModelInferResponse()
    expected.CopyFrom(reply)
    expected.parameters[FRONT_BATCH_PARAMETER].int64_param = 48
    assert sent.infer_response == expected

"""The Open Inference Protocol's messages in frames on a byte stream (TCP, or TLS where the server has TLS):
how the router calls this project's stages on the fastest path there is.

Python gRPC spends some 300 µs of CPU on each message even on a long-lived stream, several times what its
payload costs to copy; the same `ModelInferRequest` written as a frame on an asyncio stream costs tens of
microseconds at either end (`bench/grpc_floor.py` measures both). So a stage service also listens on a
frame port, which it names in `ServerMetadata.extensions` (`FRAMES_EXTENSION:PORT`), and the router sends it
its batches there: the same messages, the same parameters for the deadline and the trace context, and the
same status on a failed request as a `ModelStreamInfer` response carries (`pipeline.protocol.streams`).
Everything else (health, metadata, configuration, repository control, every other client) stays gRPC.
Under TLS the two cost about the same CPU per request: encrypting and copying the bytes then dominates.

A frame is a 5-byte header (the payload's length, 4 bytes little-endian, and its kind) and a serialized
message: `HELLO` (a `ModelInferRequest` whose parameters carry the caller's `authorization`, where the
server asks for a token), `REQUEST` (a `ModelInferRequest`) and `RESPONSE` (a `ModelStreamInferResponse`,
matched to its request by `id`). `CANCEL` carries the `id` of a request its caller no longer waits for (its
own caller went away, or its deadline passed), as UTF-8: the server stops it, as gRPC's cancellation stops a
unary call, and answers nothing. A server that takes `CANCEL` says so in the answer to the hello
(`CANCELS_PARAMETER`); a caller sends none to a server that does not.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from collections.abc import Callable
from typing import TypeVar, cast

from google.protobuf.message import Message

#: `ServerMetadata.extensions` entry, `pipeline_frames:PORT`: the server takes frames on that port.
FRAMES_EXTENSION = "pipeline_frames"
#: The frame header: payload length, kind.
HEADER = struct.Struct("<IB")
HELLO, REQUEST, RESPONSE, CANCEL = 1, 2, 3, 4
#: The parameter of the answer to a `HELLO` that says the server takes `CANCEL` frames.
CANCELS_PARAMETER = "pipeline.cancels"
#: The parameter of a `HELLO` that carries the caller's `authorization` metadata.
AUTHORIZATION = "authorization"
#: The parameter of a `HELLO` that carries a door's secret (`pipeline.runtime.frame_server`: the router's
#: compiled front), and the request parameter that carries, on a door, the identities of the caller's verified
#: client certificate (one a line) beside its `AUTHORIZATION`.
DOOR_PARAMETER = "pipeline.door"
IDENTITIES_PARAMETER = "pipeline.peer_identities"


def frame(kind: int, payload: bytes) -> bytes:
    """A frame of `kind` carrying `payload`."""
    return HEADER.pack(len(payload), kind) + payload


#: The tag of `ModelStreamInferResponse.infer_response`: field 2, length-delimited.
_INFER_RESPONSE_TAG = 0x12


def stream_response(reply: Message) -> tuple[bytes, bytes]:
    """The `ModelStreamInferResponse` that carries `reply` (a `ModelInferResponse`), as two pieces to write one
    after the other: in protobuf's wire format that message is the field's tag and length, then the reply's
    own bytes, so the reply is serialized once instead of being copied into a new message first."""
    inner = reply.SerializeToString()
    prefix = bytearray((_INFER_RESPONSE_TAG,))
    length = len(inner)
    while length >= 0x80:  # the length as a varint: seven bits a byte, low bits first
        prefix.append(length & 0x7F | 0x80)
        length >>= 7
    prefix.append(length)
    return bytes(prefix), inner


M = TypeVar("M", bound=Message)


def parse(message: type[M], payload: bytearray) -> M:
    """A `message` from a frame's payload as it was read (protobuf's parser takes any buffer without
    copying it; its type stubs name `bytes` only)."""
    return message.FromString(cast(bytes, payload))


def extension(port: int) -> str:
    """The `ServerMetadata.extensions` entry of a server taking frames on `port`."""
    return f"{FRAMES_EXTENSION}:{port}"


def port_of(extensions: frozenset[str] | tuple[str, ...]) -> int | None:
    """The frame port a server's extensions name, or None."""
    for entry in extensions:
        name, sep, port = entry.partition(":")
        if sep and name == FRAMES_EXTENSION and port.isdigit():
            return int(port)
    return None


#: Bytes read into one buffer while no payload is being read: the headers and small frames of several
#: messages come in one read.
_SCRATCH = 64 * 1024
#: Bytes of frames received and not yet `read()` past which the connection is no longer read from.
READ_AHEAD = 1 << 20
#: Bytes waiting in the transport's write buffer past which `drain()` waits.
WRITE_AHEAD = 1 << 20


class FrameProtocol(asyncio.BufferedProtocol):
    """One connection's frames, read and written with as few copies as there can be.

    asyncio's `StreamReader` gathers what arrives in one buffer and copies every `readexactly` out of it; for
    frames of hundreds of kilobytes that costs more CPU than the round trip's system calls. Here a payload
    larger than what one read brings is read straight into a buffer of its own length, which the message
    parser takes as it is, and a frame is written as header and payload without joining them.

    A frame received goes to `deliver_to`'s callback where one is set (the router's connection matches
    responses as they come), else it waits for `read()` (a server reads requests when it can take them): while
    more than `READ_AHEAD` bytes wait there, the connection is not read from, so a peer cannot send faster
    than it is served.
    """

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(_SCRATCH)
        self._held = 0  # bytes at the start of the scratch buffer that are a header's beginning
        self._payload: bytearray | None = None  # the payload being read into, past what scratch held
        self._filled = 0
        self._kind = 0
        self._frames: deque[tuple[int, bytearray]] = deque()
        self._unread = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._on_frame: Callable[[int, bytearray], None] | None = None
        self._on_end: Callable[[Exception], None] | None = None
        #: Why no more frames come (None while they may): `EOFError` where the peer ended at a frame's end.
        self.ended: Exception | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        #: Whether the peer may still read once it has ended its side (TLS closes both sides at once).
        self._half_close = True
        #: Frames written since the loop last ran its callbacks, sent together (`_flush`): one system call
        #: for all the frames a loop iteration writes instead of one each.
        self._outgoing: list[bytes] = []
        self._outgoing_bytes = 0
        self._loop = asyncio.get_running_loop()

    def deliver_to(
        self, on_frame: Callable[[int, bytearray], None], on_end: Callable[[Exception], None]
    ) -> None:
        """From now on, hand each frame to `on_frame` as it comes (those waiting first), and why frames end
        to `on_end`, once."""
        self._on_frame, self._on_end = on_frame, on_end
        while self._frames:
            on_frame(*self._frames.popleft())
        self._unread = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        if self.ended is not None:
            on_end(self.ended)

    async def read(self) -> tuple[int, bytearray]:
        """The next frame's kind and payload; raises `EOFError` where the peer ended at a frame's end,
        `ConnectionError` where the connection broke or sent too large a frame."""
        while not self._frames:
            if self.ended is not None:
                raise self.ended
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        kind, payload = self._frames.popleft()
        self._unread -= len(payload)
        if self._paused and self._unread <= READ_AHEAD and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return kind, payload

    def write(self, kind: int, *payload: bytes) -> None:
        """Send a frame whose payload is the pieces given, one after the other (raises `ConnectionError` once
        the connection is closing). The frames written in one iteration of the event loop go out together
        at its end, or at once past `WRITE_AHEAD` bytes."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionError("the frame connection is closed")
        length = sum(map(len, payload))
        outgoing = self._outgoing
        if not outgoing:
            self._loop.call_soon(self._flush)
        outgoing.append(HEADER.pack(length, kind))
        outgoing.extend(payload)
        self._outgoing_bytes += length
        if self._outgoing_bytes > WRITE_AHEAD:
            self._flush()

    def _flush(self) -> None:
        """Hand the frames written so far to the transport, in one call."""
        outgoing = self._outgoing
        if not outgoing:
            return
        self._outgoing, self._outgoing_bytes = [], 0
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.writelines(outgoing)

    async def drain(self) -> None:
        """Wait while more than `WRITE_AHEAD` bytes wait to be sent."""
        if self._writable is not None:
            await self._writable
            if self.closed.done():
                raise ConnectionError("the frame connection was lost")

    def close(self) -> None:
        self._flush()  # what was written goes before the connection closes
        if self.transport is not None:
            self.transport.close()

    # asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        transport.set_write_buffer_limits(high=WRITE_AHEAD)
        self._half_close = transport.get_extra_info("sslcontext") is None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._payload is not None:
            return memoryview(self._payload)[self._filled :]
        return memoryview(self._scratch)[self._held :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._payload is not None:
            self._filled += nbytes
            if self._filled == len(self._payload):
                payload, self._payload = self._payload, None
                self._received(self._kind, payload)
            return
        scratch, end, at = self._scratch, self._held + nbytes, 0
        while end - at >= HEADER.size and self.ended is None:
            length, kind = HEADER.unpack_from(scratch, at)
            if length > self.max_frame_bytes:
                self._end(ConnectionError(f"a frame of {length} bytes, more than {self.max_frame_bytes}"))
                assert self.transport is not None
                self.transport.abort()
                return
            start = at + HEADER.size
            if end - start < length:  # the rest of this payload is read straight into its own buffer
                self._payload = payload = bytearray(length)
                payload[: end - start] = scratch[start:end]
                self._filled, self._kind, self._held = end - start, kind, 0
                return
            at = start + length
            self._received(kind, scratch[start:at])
        self._held = end - at
        if at and self._held:
            scratch[: self._held] = scratch[at:end]

    def _received(self, kind: int, payload: bytearray) -> None:
        if self._on_frame is not None:
            self._on_frame(kind, payload)
            return
        self._frames.append((kind, payload))
        self._unread += len(payload)
        if self._unread > READ_AHEAD and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        inside = self._payload is not None or self._held
        self._end(ConnectionError("the connection ended inside a frame") if inside else EOFError())
        return self._half_close  # the peer may still read: answers go out before the connection closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(ConnectionError(f"the frame connection was lost: {exc}") if exc else EOFError())
        if not self.closed.done():
            self.closed.set_result(None)
        self.resume_writing()

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def _end(self, reason: Exception) -> None:
        if self.ended is not None:
            return
        self.ended = reason
        if self._on_end is not None:
            self._on_end(reason)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

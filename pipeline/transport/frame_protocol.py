"""A connection's frames (`pipeline.protocol.frames`: the wire format) on an asyncio stream: `FrameProtocol`, the
one both ends of a frame connection use (`pipeline.transport.frame_client`, `pipeline.transport.frame_server`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import cast

from pipeline.protocol.frames import HEADER

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
        #: Whether this iteration of the event loop has written a frame: the frames written after it in the same
        #: iteration wait in `_outgoing` and go together at its end (`_flush`), one system call for them all.
        self._gathering = False
        #: Frames written in this iteration, and whether the last iteration that wrote wrote several (then the
        #: next one gathers from its first frame on: under load, a batch's answers leave in one call).
        self._written = 0
        self._several = False
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
        the connection is closing). The first frame written in an iteration of the event loop goes at once,
        unless the last iteration that wrote wrote several; the others go together at the iteration's end, or
        at once past `WRITE_AHEAD` bytes."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionError("the frame connection is closed")
        length = sum(map(len, payload))
        self._written += 1
        if not self._gathering:
            self._gathering = True
            self._loop.call_soon(self._flush)
            if not self._several:
                # NOTE: a lone frame (every hop of a request at low load) leaves before the loop's other callbacks
                # and its next turn.
                transport.writelines((HEADER.pack(length, kind), *payload))
                return
        outgoing = self._outgoing
        outgoing.append(HEADER.pack(length, kind))
        outgoing.extend(payload)
        self._outgoing_bytes += length
        if self._outgoing_bytes > WRITE_AHEAD:
            self._send_gathered()

    def _flush(self) -> None:
        """At the end of an iteration that wrote: send the frames gathered in it, in one call."""
        self._send_gathered()
        self._gathering = False
        self._several, self._written = self._written > 1, 0

    def _send_gathered(self) -> None:
        """Hand the frames gathered so far to the transport, in one call."""
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
        self._send_gathered()  # what was written goes before the connection closes
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

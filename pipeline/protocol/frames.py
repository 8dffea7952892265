"""The Open Inference Protocol's messages in frames on a plain byte stream: how the router calls this
project's stages on the fastest path there is.

Python gRPC spends some 300 µs of CPU on each message even on a long-lived stream, several times what its
payload costs to copy; the same `ModelInferRequest` written as a frame on an asyncio stream costs tens of
microseconds at either end (`bench/grpc_floor.py` measures both). So a stage service also listens on a
frame port, which it names in `ServerMetadata.extensions` (`FRAMES_EXTENSION:PORT`), and the router sends it
its batches there: the same messages, the same parameters for the deadline and the trace context, and the
same status on a failed request as a `ModelStreamInfer` response carries (`pipeline.protocol.streams`).
Everything else (health, metadata, configuration, repository control, every other client) stays gRPC.

A frame is a 5-byte header (the payload's length, 4 bytes little-endian, and its kind) and a serialized
message: `HELLO` (a `ModelInferRequest` whose parameters carry the caller's `authorization`, where the
server asks for a token), `REQUEST` (a `ModelInferRequest`) and `RESPONSE` (a `ModelStreamInferResponse`,
matched to its request by `id`).
"""

from __future__ import annotations

import struct

#: `ServerMetadata.extensions` entry, `pipeline_frames:PORT`: the server takes frames on that port.
FRAMES_EXTENSION = "pipeline_frames"
#: The frame header: payload length, kind.
HEADER = struct.Struct("<IB")
HELLO, REQUEST, RESPONSE = 1, 2, 3
#: The parameter of a `HELLO` that carries the caller's `authorization` metadata.
AUTHORIZATION = "authorization"


def frame(kind: int, payload: bytes) -> bytes:
    """A frame of `kind` carrying `payload`."""
    return HEADER.pack(len(payload), kind) + payload


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

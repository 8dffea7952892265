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

This module is the wire format; the connections that carry it are the transport's
(`pipeline.transport.frame_protocol`, and its client and server).
"""

from __future__ import annotations

import struct
from typing import TypeVar, cast

import grpc
from google.protobuf.message import Message

from pipeline._gen.inference import grpc_service_pb2 as pb

#: `ServerMetadata.extensions` entry, `pipeline_frames:PORT`: the server takes frames on that port.
FRAMES_EXTENSION = "pipeline_frames"
#: The frame header: payload length, kind.
HEADER = struct.Struct("<IB")
HELLO, REQUEST, RESPONSE, CANCEL = 1, 2, 3, 4
#: The parameter of the answer to a `HELLO` that says the server takes `CANCEL` frames.
CANCELS_PARAMETER = "pipeline.cancels"
#: The parameter of a `HELLO` that carries the caller's `authorization` metadata.
AUTHORIZATION = "authorization"
#: The parameter of a `HELLO` that carries a door's secret (`pipeline.transport.frame_server`: the router's
#: compiled front), and the request parameter that carries, on a door, the identities of the caller's verified
#: client certificate (one a line) beside its `AUTHORIZATION`.
DOOR_PARAMETER = "pipeline.door"
IDENTITIES_PARAMETER = "pipeline.peer_identities"
#: On a door (the router's compiled front), the front merges requests of a model into one where the router
#: says it may: the response parameter that says so on each answer of that model (int64: the most items a
#: merged request may carry; absent: merge none), the request parameter of a merged request (int64: how many
#: requests it carries, each counted in the statistics), and the response parameter of a merged request that
#: failed with an error one of its requests may have caused (bool: send each alone; the failure is then not
#: counted, each request being counted as it fares alone).
FRONT_BATCH_PARAMETER = "pipeline.front_batch"
MERGED_PARAMETER = "pipeline.merged"
RESEND_PARAMETER = "pipeline.resend_alone"
#: The codes of a merged request's failure that one of its requests may have caused (its values, its size):
#: the front then sends each alone, so that one bad request gets its own error and fails no other. The
#: others (the model unavailable, a deadline, the caller's credentials) are every request's alike.
RESEND_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DATA_LOSS,
    }
)


def failed_requests(requests: int, outcome: str) -> int:
    """How many failed requests a call carrying `requests` of them (more than one: merged by the front) counts
    when it failed with `outcome` (a status code's name): none for merged requests that the front sends again
    each alone (`RESEND_CODES`), each then counted as it fares."""
    if requests == 1:
        return 1
    return 0 if grpc.StatusCode[outcome] in RESEND_CODES else requests


def frame(kind: int, payload: bytes) -> bytes:
    """A frame of `kind` carrying `payload`."""
    return HEADER.pack(len(payload), kind) + payload


#: The tag of `ModelStreamInferResponse.infer_response`: field 2, length-delimited.
_INFER_RESPONSE_TAG = 0x12


def stream_response(reply: Message, extra: bytes = b"") -> tuple[bytes, ...]:
    """The `ModelStreamInferResponse` that carries `reply` (a `ModelInferResponse`), as pieces to write one
    after the other: in protobuf's wire format that message is the field's tag and length, then the reply's
    own bytes, so the reply is serialized once instead of being copied into a new message first. `extra`:
    more of the reply's fields, serialized (`int64_parameter`), which protobuf merges into it."""
    inner = reply.SerializeToString()
    prefix = bytearray((_INFER_RESPONSE_TAG,))
    length = len(inner) + len(extra)
    while length >= 0x80:  # the length as a varint: seven bits a byte, low bits first
        prefix.append(length & 0x7F | 0x80)
        length >>= 7
    prefix.append(length)
    return (bytes(prefix), inner, extra) if extra else (bytes(prefix), inner)


def int64_parameter(key: str, value: int) -> bytes:
    """A `parameters` entry (field 4 of a `ModelInferRequest` and a `ModelInferResponse`) of `key` set to
    `value`, serialized: appended to a message's bytes, protobuf merges it into the message's map."""
    message = pb.ModelInferResponse()
    message.parameters[key].int64_param = value
    return message.SerializeToString()


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

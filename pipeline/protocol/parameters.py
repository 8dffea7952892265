"""The request parameters the protocol reserves that carry numbers (`priority`, `timeout`), read one way
everywhere."""

from __future__ import annotations

from collections.abc import Mapping

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import InvalidInput

#: A request's time in a queue, in microseconds (Triton's `timeout`).
TIMEOUT = "timeout"
#: A request's priority level (1 is the highest).
PRIORITY = "priority"


def int_parameter(parameters: Mapping[str, pb.InferParameter], key: str) -> int | None:
    """A request parameter given as int64 or uint64 (`priority`, `timeout`), or None."""
    if key not in parameters:
        return None
    param = parameters[key]
    choice = param.WhichOneof("parameter_choice")
    if choice in ("int64_param", "uint64_param"):
        return int(getattr(param, choice))
    raise InvalidInput(f"request parameter '{key}' must be an integer, got {choice}")

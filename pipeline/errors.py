"""One error hierarchy, each error carrying the gRPC status code it maps to.

Handlers raise these; the servicers turn them into a status with `abort`. Anything else that escapes a
handler is an internal error and its details are logged, not sent to the client.
"""

from __future__ import annotations

import grpc


class PipelineError(Exception):
    """Base class: an error whose message is safe to show to the client."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(PipelineError):
    """The request is malformed: wrong tensor name, datatype, shape, byte count or content."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(PipelineError):
    """No model (ensemble or stage model) of that name or version is served here."""

    code = grpc.StatusCode.NOT_FOUND


class Unavailable(PipelineError):
    """A model or the stage that serves it cannot take requests now."""

    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(PipelineError):
    """The request is larger than a configured limit allows."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(PipelineError):
    """The request's deadline passed before it could be completed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unimplemented(PipelineError):
    """The RPC or feature is not supported by this server."""

    code = grpc.StatusCode.UNIMPLEMENTED


class StageError(PipelineError):
    """A stage answered with an error; the router passes its code on and names the stage."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code

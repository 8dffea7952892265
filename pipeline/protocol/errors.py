"""One error hierarchy, each error carrying the gRPC status code it maps to.

Handlers raise these; the servicers turn them into a status with `abort`. Anything else that escapes a
handler is an internal error and its details are logged, not sent to the client.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc

#: `google.rpc.ErrorInfo` that a server puts on a deliberate UNAVAILABLE (a model not loaded yet, a full
#: queue): it did not start the call, which may go to another replica, never back to the same one.
ERROR_DOMAIN = "pipeline.inference"
NOT_STARTED = "NOT_STARTED"

_FIELD = re.compile(r"(.+)\[(\d+)\]")

#: The most characters of a client's string (a model, version or tensor name, a header) that an error
#: message repeats.
ECHO_LIMIT = 200
#: The most characters of an error message. gRPC sends it in a trailer (percent-encoded), and a trailer
#: over 16 KB turns the answer into RESOURCE_EXHAUSTED: whatever a message repeats, it stays well below.
MESSAGE_LIMIT = 2000


def echo(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text` as an error message may repeat it: at most `limit` characters, and how long it was when cut.
    A client's strings are repeated through this, so a 100 KB name makes a short message."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


#: The most names (of tensors, models) an error message lists; it says how many more there are.
NAMES_LIMIT = 8


def names_of(names: Iterable[str], limit: int = NAMES_LIMIT) -> str:
    """`names` as an error message lists them: the first `limit`, each cut as `echo` cuts it, then how many
    more there are ("A, B, C and 199,997 more"); "none" for none. A model with 200,000 inputs makes a short
    message that still says what was expected."""
    listed = list(names)
    if not listed:
        return "none"
    shown = ", ".join(echo(name) for name in listed[:limit])
    more = len(listed) - limit
    return f"{shown} and {more:,} more" if more > 0 else shown


@dataclass(frozen=True, slots=True)
class ItemError:
    """One refused item of a batch: the tensor, the item's index in dimension 0, and what is wrong. Sent
    as a `google.rpc.BadRequest` field violation whose field is `TENSOR[index]`."""

    tensor: str
    index: int
    description: str

    @property
    def field(self) -> str:
        return f"{self.tensor}[{self.index}]"

    @classmethod
    def from_field(cls, field: str, description: str) -> ItemError | None:
        """The item a field violation names, or None when its field is not `TENSOR[index]`."""
        match = _FIELD.fullmatch(field)
        if match is None:
            return None
        return cls(match.group(1), int(match.group(2)), description)


class PipelineError(Exception):
    """Base class: an error whose message is safe to show to the client."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    #: The items of a batch this error is about, sent to the client as structured details.
    items: tuple[ItemError, ...] = ()

    def __init__(self, message: str) -> None:
        message = echo(message, MESSAGE_LIMIT)
        super().__init__(message)
        self.message = message


class InvalidInput(PipelineError):
    """The request is malformed: wrong tensor name, datatype, shape, byte count or content.

    `items` names the refused items of a batch (each tensor and index); `for_items` builds the error from
    every bad item a stage found, so one answer reports them all."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, *, items: Sequence[ItemError] = ()) -> None:
        super().__init__(message)
        self.items = tuple(items)

    @classmethod
    def for_items(cls, items: Sequence[ItemError]) -> InvalidInput:
        """One error for several bad items: the message lists each as `TENSOR[i]: what`."""
        return cls("; ".join(f"{item.field}: {item.description}" for item in items), items=items)


class ModelNotFound(PipelineError):
    """No model (ensemble or stage model) of that name or version is served here."""

    code = grpc.StatusCode.NOT_FOUND


class Unavailable(PipelineError):
    """A model or the stage that serves it cannot take requests now."""

    code = grpc.StatusCode.UNAVAILABLE


class Stopped(PipelineError):
    """The server stopped while it still held the request: its grace period was over. The request may have
    started (a model that never returned), so unlike `Unavailable` it is not marked NOT_STARTED."""

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

    def __init__(self, message: str, code: grpc.StatusCode, *, items: Sequence[ItemError] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.items = tuple(items)


class ConfigError(ValueError):
    """An ensemble file (or a set of them) is invalid; the message names the file, step and tensor."""


class RepositoryError(PipelineError):
    """A repository entry cannot be served: a bad config or artifact, a path that leaves the repository."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class RepositoryNotFound(RepositoryError):
    """A model or version that the repository does not hold."""

    code = grpc.StatusCode.NOT_FOUND

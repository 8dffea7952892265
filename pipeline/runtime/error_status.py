"""A `PipelineError` as the client reads it: the `google.rpc.Status` details of its gRPC status (refused
items, a call refused before it started), the answer to an unexpected error (logged under an incident id),
and the status code name a request is counted under. One home for every front door and stream."""

from __future__ import annotations

import asyncio
import logging
import uuid

from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from pipeline.protocol.errors import ERROR_DOMAIN, NOT_STARTED, PipelineError, Unavailable

log = logging.getLogger(__name__)


#: The most bytes of `BadRequest` details one error carries: with its message, base64 in a trailer, well
#: within the 8 KiB of metadata a gRPC client accepts by default (past it, the call fails RESOURCE_EXHAUSTED).
MAX_DETAILS_BYTES = 4096


def rpc_status_of(err: PipelineError) -> status_pb2.Status | None:
    """The `google.rpc.Status` of an error that has details: a `BadRequest` field violation `TENSOR[i]` per
    refused item (as many as `MAX_DETAILS_BYTES` holds), and `ErrorInfo` NOT_STARTED on an UNAVAILABLE (the call was refused before it started, so a
    client may send it to another replica). None for an error without details."""
    details = []
    if err.items:
        bad = error_details_pb2.BadRequest()
        size = 0
        for item in err.items:
            violation = bad.field_violations.add(field=item.field, description=item.description)
            size += violation.ByteSize() + 3
            if size > MAX_DETAILS_BYTES:
                # The first items only: the trailers must fit a client's 8 KiB metadata limit. A router
                # sends the rest of its batch again, and the items left unnamed are refused then.
                del bad.field_violations[-1]
                break
        details.append(bad)
    if isinstance(err, Unavailable):
        details.append(error_details_pb2.ErrorInfo(reason=NOT_STARTED, domain=ERROR_DOMAIN))
    if not details:
        return None
    status = status_pb2.Status(code=err.code.value[0], message=err.message)
    for detail in details:
        status.details.add().Pack(detail)
    return status


def status_details(err: PipelineError) -> tuple[tuple[str, bytes], ...]:
    """The `google.rpc.Status` details of an error, as trailing metadata (grpcio-status)."""
    status = rpc_status_of(err)
    return () if status is None else tuple(rpc_status.to_status(status).trailing_metadata)


def internal_error(error: BaseException | None = None) -> str:
    """Log `error` (by default the exception being handled) under a new incident id; return what the client
    is told instead."""
    incident = uuid.uuid4().hex[:12]
    log.error("internal error, incident %s", incident, exc_info=error or True)
    return f"internal error (incident {incident} in the server log)"


def outcome_of(err: BaseException) -> str:
    """The gRPC status code name a request that raised `err` is answered with."""
    if isinstance(err, PipelineError):
        return err.code.name
    if isinstance(err, asyncio.CancelledError):
        return "CANCELLED"
    return "INTERNAL"

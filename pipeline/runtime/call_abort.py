"""Ending a gRPC call with an error status, without keeping its request in memory afterwards.

grpc.aio's `context.abort()` raises an `AbortError` and keeps it on the call's state, which the handler's
context refers to. Raised through the handler, the error's traceback holds every frame it passes, with their
locals: the context (so the call's state, so the error again: a reference cycle) and the request. Only the
garbage collector's full passes free such cycles, and they are rare in a server that allocates few objects:
20 refused `RepositoryModelLoad` calls of 40 MB each kept about 800 MB in the router. `abort` ends the call
the same way and lets the handler return: gRPC raises the kept error again from its own frames, which hold
no locals, so everything the handler held is freed as soon as it returns.
"""

from __future__ import annotations

import grpc


async def abort(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    details: str,
    trailing_metadata: tuple[tuple[str, str | bytes], ...] = (),
) -> None:
    """Send `code` and `details` (and `trailing_metadata`) as the call's status, and return: the handler must
    then return too (a unary handler's return value is discarded, a streaming handler must yield nothing
    more), and gRPC ends the call as `context.abort()` does."""
    try:
        await context.abort(code, details, trailing_metadata)
    except grpc.aio.AbortError as raised:
        raised.__traceback__ = None  # its frames (this one's context among them) stay with nobody

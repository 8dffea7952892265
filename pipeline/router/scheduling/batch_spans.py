"""The span of one batch: a `batch` span for the stage call, linked to the span of every member.

A batch's span is a child of its first traced member's span and is linked to every member's span, as
OpenTelemetry's conventions for batch processing have it (a batch span links to what it processes); each
member's span gets the batch's size. A member's wait in the queue is the time from the start of its step's
span to the start of the batch span; `pipeline trace` shows a member the batch that links to it.

NOTE: with every request traced, each span, link and attribute is paid per request (making it, then encoding
it for export), so a member gets one attribute here: no span of its own and no link back to its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.trace import Link, Span, SpanKind, Tracer, set_span_in_context

from pipeline.runtime.telemetry import BATCH_REQUESTS, BATCH_SIZE, MODEL


def batch_span(tracer: Tracer, model: str, members: Sequence[Span], size: int, requests: int) -> Span:
    """Start the span of a batch of `requests` requests holding `size` items, linked with each traced
    member's span (the first member first)."""
    batch = tracer.start_span(
        f"batch {model}",
        context=set_span_in_context(members[0]),
        kind=SpanKind.CLIENT,
        links=[Link(span.get_span_context()) for span in members],
        attributes={MODEL: model, BATCH_SIZE: size, BATCH_REQUESTS: requests},
    )
    for span in members:
        span.set_attribute(BATCH_SIZE, size)
    return batch

"""The span of one batch: a `batch` span for the stage call, linked to the span of every member.

A batch's span is a child of its first traced member's span and is linked to every member's span; each
member's span gets the batch's size and, past the first (whose trace holds the batch span itself), a link to
the batch, so that its own trace says which batch it rode in. A member's wait in the queue is the time from
the start of its step's span to the start of the batch span.

NOTE: with every request traced, each span and attribute is paid per request (the SDK's span, then its
encoding for export), so a member gets one attribute and one link here, not a span of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.trace import Link, Span, SpanKind, Tracer, set_span_in_context

from pipeline.runtime.telemetry import BATCH_REQUESTS, BATCH_SIZE, MODEL

#: The attribute on a member's link to its batch, which tells `pipeline trace` to follow it.
BATCH_LINK = {"pipeline.link": "batch"}


def batch_span(tracer: Tracer, model: str, members: Sequence[Span], size: int, requests: int) -> Span:
    """Start the span of a batch of `requests` requests holding `size` items, linked with each traced
    member's span (the first member first)."""
    first = members[0]
    batch = tracer.start_span(
        f"batch {model}",
        context=set_span_in_context(first),
        kind=SpanKind.CLIENT,
        links=[Link(span.get_span_context()) for span in members],
        attributes={MODEL: model, BATCH_SIZE: size, BATCH_REQUESTS: requests},
    )
    context = batch.get_span_context()
    for index, span in enumerate(members):
        if span.is_recording():
            span.set_attribute(BATCH_SIZE, size)
            if index:
                span.add_link(context, BATCH_LINK)
    return batch

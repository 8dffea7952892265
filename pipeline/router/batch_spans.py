"""The spans of one batch: a `batch` span for the stage call, and a `queue` span per traced member.

A batch's span is a child of its first traced member's span and is linked to every member's span; each
member gets a `queue` span for its wait and the batch's size and ids as attributes (and, past the first,
a link to the batch span), so that its own trace says which batch it rode in.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry.trace import Link, Span, SpanKind, Tracer, set_span_in_context

from pipeline.runtime.telemetry import BATCH_REQUESTS, BATCH_SIZE, BATCH_SPAN_ID, BATCH_TRACE_ID, MODEL

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue


def batch_span(
    tracer: Tracer, model: str, members: Sequence[tuple[Span, int]], size: int, requests: int
) -> Span:
    """Start the span of a batch of `requests` requests holding `size` items, and end each traced member's
    queue span. `members`: each traced member's span and when it was queued (`time.time_ns()`), the first
    member first."""
    dispatched = time.time_ns()
    for span, enqueued_ns in members:
        tracer.start_span(
            f"queue {model}",
            context=set_span_in_context(span),
            attributes={MODEL: model},
            start_time=enqueued_ns,
        ).end(end_time=dispatched)
    first = members[0][0]
    batch = tracer.start_span(
        f"batch {model}",
        context=set_span_in_context(first),
        kind=SpanKind.CLIENT,
        links=[Link(span.get_span_context()) for span, _ in members],
        attributes={MODEL: model, BATCH_SIZE: size, BATCH_REQUESTS: requests},
        start_time=dispatched,
    )
    context = batch.get_span_context()
    attributes: dict[str, AttributeValue] = {
        BATCH_SIZE: size,
        BATCH_REQUESTS: requests,
        BATCH_TRACE_ID: f"{context.trace_id:032x}",
        BATCH_SPAN_ID: f"{context.span_id:016x}",
    }
    for index, (span, _) in enumerate(members):
        if span.is_recording():
            span.set_attributes(attributes)
            if index:  # the first member's trace holds the batch span itself
                span.add_link(context, {"pipeline.link": "batch"})
    return batch

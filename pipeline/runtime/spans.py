"""Spans at a fraction of the OpenTelemetry SDK's CPU, made from an SDK tracer provider's public parts.

With every request traced, the SDK's span (`opentelemetry.sdk.trace.Span`) costs 20–35 µs of CPU to make,
make current, end and hand on on this machine: a lock and bounded, validating containers per span, a
generator-based context manager, the tracer's own metrics and a `ReadableSpan` copied at the end. A request
through a three-step ensemble makes four or five spans in the router alone, which made tracing cost a third
of the throughput. `Tracer` here implements the same API (`opentelemetry.trace.Tracer` and `Span`) for this
project's servers at under a third of that, through the SDK's public API only:

- the sampler, ids, resource and span processors (and so the exporters and `OTEL_BSP_*`) are those of the
  SDK tracer the provider hands out (its public attributes): what the environment configures for the SDK
  configures these spans. The sampler decides each span, as the SDK asks it, but where it is one of the
  SDK's parent-based samplers with their default delegates (`DEFAULT_ON`, `DEFAULT_OFF` or a
  `ParentBasedTraceIdRatio`: what every `parentbased_*` value of OTEL_TRACES_SAMPLER, and the default, make)
  a span with a parent takes its parent's decision without asking it, as it would have decided: asking
  costs more than the rest of a span. Processors hear of a span when
  it starts (`on_start`, with the running span: a processor that copies baggage or adds attributes there
  still can) and when it ends (`on_end`, with an SDK `ReadableSpan` made by its public constructor). The
  instrumentation scope is the one the tracer was asked for; span limits are the SDK's `SpanLimits`, read
  from the `OTEL_*_LIMIT` environment variables as a provider made without limits reads them, unless given.
  The SDK's own metrics about spans (off unless OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED) are not kept;
- a running span keeps plain containers within the limits' counts; values are not validated as they are
  set: an attribute OTLP cannot carry is dropped, with a log line, when the span is encoded
  (`pipeline.runtime.otlp`);
- `start_as_current_span` returns a plain context manager that makes the span current, records an exception
  (a subclass of `Exception`, as the SDK does) and ends the span.

NOTE: a span is changed from one thread at a time in this project (its event loop, or the thread that
records a finished span), so there is no lock; a change after `end()` is ignored, as the SDK ignores it.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.sampling import DEFAULT_OFF, DEFAULT_ON, ParentBasedTraceIdRatio
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)

#: Trace flags by (sampled, random trace id).
_FLAGS = {
    (sampled, random): TraceFlags(
        (TraceFlags.SAMPLED if sampled else 0) | (TraceFlags.RANDOM_TRACE_ID if random else 0)
    )
    for sampled in (False, True)
    for random in (False, True)
}
_UNSET = Status(StatusCode.UNSET)


class Tracer(trace.Tracer):
    """Makes `RecordingSpan`s with an SDK tracer's sampler, ids, resource and processors."""

    def __init__(
        self, sdk_tracer: SdkTracer, scope: InstrumentationScope, limits: SpanLimits | None = None
    ) -> None:
        self.sampler = sdk_tracer.sampler
        self.resource = sdk_tracer.resource
        #: The provider's multi-processor: it hands each span on to the processors added to the provider
        #: (one added later included).
        self.processor = sdk_tracer.span_processor
        self.ids = sdk_tracer.id_generator
        self._random_ids = self.ids.is_trace_id_random()
        sampler = self.sampler
        self._children_follow_parent = (
            sampler is DEFAULT_ON or sampler is DEFAULT_OFF or type(sampler) is ParentBasedTraceIdRatio
        )
        self.scope = scope
        limits = limits if limits is not None else SpanLimits()
        self.max_attributes = _limit(limits.max_span_attributes)
        self.max_events = _limit(limits.max_events)
        self.max_links = _limit(limits.max_links)

    @classmethod
    def of(
        cls,
        provider: TracerProvider,
        name: str,
        version: str | None = None,
        schema_url: str | None = None,
        *,
        limits: SpanLimits | None = None,
    ) -> Tracer | None:
        """The tracer of instrumentation scope `name` over `provider`; None where the provider hands out a
        no-op tracer (the SDK disabled by OTEL_SDK_DISABLED)."""
        sdk_tracer = provider.get_tracer(name, version, schema_url)
        if not isinstance(sdk_tracer, SdkTracer):
            return None
        return cls(sdk_tracer, InstrumentationScope(name, version, schema_url), limits)

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        current = trace.get_current_span(context).get_span_context()
        links = links or ()
        parent = current if current.is_valid else None
        trace_state: TraceState | None
        if parent is not None and self._children_follow_parent:
            # What the SDK's parent-based sampler with its default delegates decides, without asking it.
            trace_id, trace_state = parent.trace_id, parent.trace_state
            recording = sampled = parent.trace_flags.sampled
        else:
            trace_id = parent.trace_id if parent is not None else self.ids.generate_trace_id()
            sampling = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
            recording, sampled = sampling.decision.is_recording(), sampling.decision.is_sampled()
            # NOTE: as in the SDK, a span's attributes are the sampler's (its own samplers pass them through).
            trace_state, attributes = sampling.trace_state, sampling.attributes
        random = parent.trace_flags.random_trace_id if parent is not None else self._random_ids
        span_context = SpanContext(
            trace_id, self.ids.generate_span_id(), False, _FLAGS[sampled, random], trace_state
        )
        if not recording:
            return NonRecordingSpan(span_context)
        span = RecordingSpan(self, name, span_context, parent, kind, attributes, links, start_time)
        self.processor.on_start(span, parent_context=context)  # type: ignore[arg-type]  # (SDK's span type)
        if not record_exception:
            span.record_exceptions = False
        if not set_status_on_exception:
            span.status_on_exception = False
        return span

    def start_as_current_span(  # type: ignore[override]  # (a context manager object, not a generator's)
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Current:
        span = self.start_span(
            name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception
        )
        return Current(span, end_on_exit)


def _limit(limit: int | None) -> int:
    """A span limit as a count (the SDK's None: no limit)."""
    return sys.maxsize if limit is None else limit


class Current:
    """A span made current for a `with` block: an `Exception` leaving it is recorded on it (as the span was
    started to), and the span ends with the block unless told otherwise."""

    __slots__ = ("_end", "_span", "_token")

    def __init__(self, span: trace.Span, end_on_exit: bool = True) -> None:
        self._span = span
        self._end = end_on_exit

    def __enter__(self) -> trace.Span:
        self._token = context_api.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        context_api.detach(self._token)
        span = self._span
        if isinstance(error, Exception) and isinstance(span, RecordingSpan):
            if span.record_exceptions:
                span.record_exception(error)
            if span.status_on_exception:
                span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        if self._end:
            span.end()


class FinishedSpan(ReadableSpan):
    """An ended span as processors and exporters read it: the SDK's `ReadableSpan` with what the limits
    dropped counted."""

    def __init__(self, span: RecordingSpan) -> None:
        super().__init__(
            name=span.name,
            context=span.context,
            parent=span.parent,
            resource=span.resource,
            attributes=span.attributes,
            events=span.events,
            links=span.links,
            kind=span.kind,
            status=span.status,
            start_time=span.start_time,
            end_time=span.end_time,
            instrumentation_scope=span.instrumentation_scope,
        )
        self._dropped = (span.dropped_attributes, span.dropped_events, span.dropped_links)

    @property
    def dropped_attributes(self) -> int:
        return self._dropped[0]

    @property
    def dropped_events(self) -> int:
        return self._dropped[1]

    @property
    def dropped_links(self) -> int:
        return self._dropped[2]


class RecordingSpan(trace.Span):
    """A recording span while it runs; processors get a `FinishedSpan` of it when it ends."""

    # NOTE: what most spans keep as they start is a class attribute until a span changes it.
    status: Status = _UNSET
    end_time: int | None = None
    events: Sequence[Event] = ()
    links: Sequence[Link] = ()
    dropped_attributes = dropped_events = dropped_links = 0
    record_exceptions = True
    status_on_exception = True

    def __init__(
        self,
        tracer: Tracer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: Attributes,
        links: Sequence[Link],
        start_time: int | None,
    ) -> None:
        self._tracer = tracer
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.start_time = start_time if start_time is not None else time.time_ns()
        self.attributes: dict[str, Any] = {}
        if attributes:
            self.set_attributes(attributes)
        for link in links:
            self._add_link(link)

    @property
    def resource(self) -> Resource:
        return self._tracer.resource

    @property
    def instrumentation_scope(self) -> InstrumentationScope:
        return self._tracer.scope

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.end_time is not None:
            return
        mine = self.attributes
        if len(mine) + len(attributes) <= self._tracer.max_attributes:
            mine.update(attributes)
            return
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is not None:
            return
        mine = self.attributes
        if key in mine or len(mine) < self._tracer.max_attributes:
            mine[key] = value
        else:
            self.dropped_attributes += 1

    def add_event(self, name: str, attributes: Attributes = None, timestamp: int | None = None) -> None:
        if self.end_time is not None:
            return
        if len(self.events) < self._tracer.max_events:
            if not self.events:
                self.events = []
            self.events.append(Event(name, attributes, timestamp))  # type: ignore[attr-defined]
        else:
            self.dropped_events += 1

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        if self.end_time is None and context.is_valid:
            self._add_link(Link(context, attributes))

    def _add_link(self, link: Link) -> None:
        if len(self.links) < self._tracer.max_links:
            if not self.links:
                self.links = []
            self.links.append(link)  # type: ignore[attr-defined]
        else:
            self.dropped_links += 1

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # As the SDK: an OK status is final, and UNSET changes nothing.
        if self.end_time is not None or self.status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self.status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        kind = type(exception)
        module = kind.__module__
        # OpenTelemetry's semantic conventions for an exception event.
        event: dict[str, Any] = {
            "exception.type": (
                f"{module}.{kind.__qualname__}" if module and module != "builtins" else kind.__qualname__
            ),
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            log.warning("span '%s' ended twice", self.name)
            return
        self.end_time = end_time if end_time is not None else time.time_ns()
        self._tracer.processor.on_end(FinishedSpan(self))

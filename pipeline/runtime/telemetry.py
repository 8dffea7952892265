"""Tracing: one OpenTelemetry trace per request, across the router and every stage service.

Each server holds a `Telemetry` made around an SDK tracer provider that is passed in (tests give one with an
in-memory exporter) or built from OpenTelemetry's standard environment variables by `Telemetry.from_env`; its
spans are made by `pipeline.runtime.spans` from the provider's sampler, ids, resource and processors.
With tracing off (the default: `OTEL_TRACES_EXPORTER` unset or `none`) `enabled` is False and every helper
returns at once, so the hot path pays an attribute check and no span objects.

Context crosses processes as W3C `traceparent`/`tracestate` gRPC metadata: the router injects the context
of the span that makes each stage call, and the stage server continues it.

Exporters (`OTEL_TRACES_EXPORTER`, comma-separated): `otlp` (the protocol from
`OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`: `grpc`, the default, or `http/protobuf`; endpoint, headers and
timeouts from the exporters' own `OTEL_EXPORTER_OTLP_*` variables; the SDK's exporters with a cheaper encoder,
`pipeline.runtime.otlp`), `console`, `jsonl` (one JSON span per
line appended to `PIPELINE_TRACE_FILE`, default `traces.jsonl`, which `pipeline trace` reads) and `none`.
The sampler comes from `OTEL_TRACES_SAMPLER`/`OTEL_TRACES_SAMPLER_ARG` through the SDK's own handling. Each
service reports as `<prefix>-<service>` where the prefix is `OTEL_SERVICE_NAME` (default `pipeline`), so
one variable names a whole deployment while its services stay apart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pipeline.runtime.otlp import GrpcSpanExporter, HttpSpanExporter
from pipeline.runtime.spans import Tracer

log = logging.getLogger(__name__)

#: The W3C Trace Context propagator: the header format every hop speaks, whatever `OTEL_PROPAGATORS` says.
PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = frozenset({"traceparent", "tracestate"})

#: One shared no-op context manager: what every span helper returns with tracing off, and what callers use
#: instead of a span scope to skip even building its attributes.
NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()

# Span attribute names; `rpc.*`, `server.*` and `error.*` are OpenTelemetry's semantic conventions.
MODEL = "pipeline.model"
STEP = "pipeline.step"
STAGE = "pipeline.stage"
REQUEST_ID = "pipeline.request_id"
#: A streamed request's response: its position among the request's responses, and whether it is the last.
RESPONSE_INDEX = "pipeline.response.index"
RESPONSE_FINAL = "pipeline.response.final"
BATCH_SIZE = "pipeline.batch.size"
BATCH_REQUESTS = "pipeline.batch.requests"
#: On a step's span: True when the request skipped the step (a condition, or an input never produced),
#: with the reason.
STEP_SKIPPED = "pipeline.step.skipped"
SKIP_REASON = "pipeline.step.skip_reason"
#: On a request's span: True when the response came from the router's response cache.
CACHE_HIT = "pipeline.cache.hit"
PEER = "server.address"
GRPC_STATUS = "rpc.grpc.status_code"
ERROR_TYPE = "error.type"

DEFAULT_SERVICE_PREFIX = "pipeline"
DEFAULT_TRACE_FILE = "traces.jsonl"


def service_name(service: str) -> str:
    """The `service.name` a service reports: `OTEL_SERVICE_NAME` (or `pipeline`) as a prefix."""
    prefix = os.environ.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_PREFIX
    return f"{prefix}-{service}"


class Telemetry:
    """Tracing for one server, around an injected tracer provider (None: tracing off).

    `owns_provider` says whether `shutdown()` should flush and shut the provider down (it does for one
    built from the environment; a test keeps its own).
    """

    def __init__(self, tracer_provider: TracerProvider | None = None, *, owns_provider: bool = False):
        self.provider = tracer_provider
        # NOTE: a provider the SDK disabled (OTEL_SDK_DISABLED) hands out a no-op tracer: tracing is off.
        self.tracer = Tracer.of(tracer_provider, "pipeline") if tracer_provider is not None else None
        self.enabled = self.tracer is not None
        self._owns_provider = owns_provider

    @classmethod
    def from_env(cls, service: str, environ: Mapping[str, str] | None = None) -> Telemetry:
        """Tracing configured by OpenTelemetry's environment variables; off unless they ask for it."""
        provider = tracer_provider_from_env(service, environ)
        return cls(provider, owns_provider=provider is not None)

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporters (only for a provider this object owns)."""
        if self._owns_provider and self.provider is not None:
            self.provider.shutdown()

    # --- spans ---------------------------------------------------------------------------------------

    def server_span(
        self, name: str, metadata: Sequence[tuple[str, str | bytes]], attributes: Mapping[str, Any]
    ) -> contextlib.AbstractContextManager[Span | None]:
        """The span of an incoming RPC, continuing the caller's `traceparent` when it sent one.

        Errors are recorded by `record_error`, which knows the status code, not by the context manager.
        """
        if self.tracer is None:
            return NO_SPAN
        return self.tracer.start_as_current_span(
            name,
            context=extract(metadata),
            kind=SpanKind.SERVER,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        )

    def span(
        self, name: str, attributes: Mapping[str, Any] | None = None, *, kind: SpanKind = SpanKind.INTERNAL
    ) -> contextlib.AbstractContextManager[Span | None]:
        """A child of the current span, made current; exceptions mark it ERROR. A no-op with tracing off."""
        if self.tracer is None:
            return NO_SPAN
        return self.tracer.start_as_current_span(name, kind=kind, attributes=attributes)

    def record_span(
        self, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None
    ) -> None:
        """A finished child of the current span with the given wall-clock times, for work timed elsewhere
        (on another thread, or in a queue)."""
        if self.tracer is None:
            return
        self.tracer.start_span(name, attributes=attributes, start_time=start_ns).end(end_time=end_ns)

    def current_span(self) -> Span | None:
        """The current span if tracing is on and it records, for attributes known only later; else None."""
        if self.tracer is None:
            return None
        span = trace.get_current_span()
        return span if span.is_recording() else None

    def inject(self, metadata: Sequence[tuple[str, str | bytes]]) -> Sequence[tuple[str, str | bytes]]:
        """`metadata` for a downstream call, carrying the current span's context instead of the caller's."""
        if self.tracer is None:
            return metadata
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier)
        if not carrier:
            return metadata
        return (*(item for item in metadata if item[0] not in _TRACE_HEADERS), *carrier.items())


def extract(metadata: Sequence[tuple[str, str | bytes]]) -> Context | None:
    """The remote span context carried by gRPC metadata (W3C `traceparent`), or None."""
    carrier = {key: value for key, value in metadata if key in _TRACE_HEADERS and isinstance(value, str)}
    return PROPAGATOR.extract(carrier) if carrier else None


def record_error(span: Span | None, err: BaseException, code: str) -> None:
    """Mark a span failed: status ERROR with the message, the gRPC code, and an exception event."""
    if span is None or not span.is_recording():
        return
    message = getattr(err, "message", None) or str(err) or type(err).__name__
    span.set_status(Status(StatusCode.ERROR, message))
    span.set_attribute(GRPC_STATUS, code)
    span.set_attribute(ERROR_TYPE, type(err).__name__)
    span.record_exception(err)


# --- configuration from the environment -------------------------------------------------------------


def tracer_provider_from_env(service: str, environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """A tracer provider with the exporters `OTEL_TRACES_EXPORTER` names, or None when it names none.

    The sampler (`OTEL_TRACES_SAMPLER[_ARG]`), resource attributes (`OTEL_RESOURCE_ATTRIBUTES`), batch
    processor limits (`OTEL_BSP_*`) and OTLP endpoints are read by the SDK and exporters themselves.
    """
    env = os.environ if environ is None else environ
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
    names = [n for n in names if n != "none"]
    if not names:
        return None
    exporters = [_exporter(name, env) for name in names]
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name(service)}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing on: exporting %s as service '%s'", ", ".join(names), service_name(service))
    return provider


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == "otlp":
        protocol = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
        ).strip()
        name = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}.get(protocol, "")
        if not name:
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: unsupported protocol {protocol!r}")
    if name == "otlp_proto_grpc":
        return GrpcSpanExporter()
    if name == "otlp_proto_http":
        return HttpSpanExporter()
    if name == "console":
        return ConsoleSpanExporter()
    if name == "jsonl":
        return JsonLinesSpanExporter(Path(env.get("PIPELINE_TRACE_FILE", DEFAULT_TRACE_FILE)))
    raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console, jsonl or none)")


# --- the JSON-lines file exporter --------------------------------------------------------------------


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as the JSON object `pipeline trace` reads: ids in hex, times in Unix nanoseconds."""
    context = span.get_span_context()
    # NOTE: the SDK gives every span it made a context; only the API's abstract type allows none.
    assert context is not None
    parent = span.parent
    return {
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "service": span.resource.attributes.get(SERVICE_NAME, ""),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_message": span.status.description,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "links": [
            {
                "trace_id": f"{link.context.trace_id:032x}",
                "span_id": f"{link.context.span_id:016x}",
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ],
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per span to a file; every service of a deployment may share the file.

    NOTE: each export is one `write` on a file opened with O_APPEND, so lines from several processes
    never interleave within a line.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans).encode()
        try:
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
        except OSError as err:
            log.warning("cannot write spans to %s: %s", self.path, err)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

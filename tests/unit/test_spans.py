"""The lean spans (`pipeline.runtime.spans`) behave as the OpenTelemetry SDK's spans do where this project and
its exporters can tell: sampling, parents, exceptions, status, limits, ended spans, the current span."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    Decision,
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)

from pipeline.runtime.spans import RecordingSpan, Tracer
from pipeline.runtime.telemetry import Telemetry

REMOTE = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def _tracer(limits: SpanLimits | None = None, **provider_args) -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(**provider_args)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = Tracer.of(provider, "pipeline", limits=limits)
    assert tracer is not None
    return tracer, exporter


def test_children_share_the_trace_and_name_their_parent():
    tracer, exporter = _tracer()
    with tracer.start_as_current_span("root", kind=SpanKind.SERVER, attributes={"a": 1}) as root:
        assert trace.get_current_span() is root
        with tracer.start_as_current_span("child") as child:
            assert trace.get_current_span() is child
        assert trace.get_current_span() is root
    assert trace.get_current_span() is trace.INVALID_SPAN
    finished = {span.name: span for span in exporter.get_finished_spans()}
    assert set(finished) == {"root", "child"}
    root_span, child_span = finished["root"], finished["child"]
    assert root_span.parent is None and root_span.kind == SpanKind.SERVER
    assert dict(root_span.attributes) == {"a": 1}
    assert child_span.context.trace_id == root_span.context.trace_id
    assert child_span.parent.span_id == root_span.context.span_id
    assert root_span.context.trace_flags.sampled and not root_span.context.is_remote
    assert root_span.start_time <= child_span.start_time <= child_span.end_time <= root_span.end_time
    assert root_span.instrumentation_scope.name == "pipeline"
    assert root_span.resource.attributes["service.name"]


def test_a_remote_parent_and_explicit_times():
    tracer, exporter = _tracer()
    span = tracer.start_span("s", context=set_span_in_context(NonRecordingSpan(REMOTE)), start_time=10)
    span.end(end_time=25)
    [done] = exporter.get_finished_spans()
    assert done.context.trace_id == REMOTE.trace_id and done.parent == REMOTE and done.parent.is_remote
    assert (done.start_time, done.end_time) == (10, 25)


def test_the_sampler_decides():
    tracer, exporter = _tracer(sampler=ALWAYS_OFF)
    with tracer.start_as_current_span("dropped") as span:
        assert not span.is_recording() and not isinstance(span, RecordingSpan)
        assert span.get_span_context().is_valid and not span.get_span_context().trace_flags.sampled
    assert exporter.get_finished_spans() == ()

    # Parent-based: a sampled remote parent wins over a ratio of 0.
    tracer, exporter = _tracer(sampler=ParentBased(TraceIdRatioBased(0.0)))
    tracer.start_span("kept", context=set_span_in_context(NonRecordingSpan(REMOTE))).end()
    tracer.start_span("root dropped").end()
    assert [span.name for span in exporter.get_finished_spans()] == ["kept"]


class _Tagging(Sampler):
    def should_sample(
        self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None
    ):
        return SamplingResult(Decision.RECORD_AND_SAMPLE, {"sampled.by": "tagging", "a": 0})

    def get_description(self) -> str:
        return "tagging"


def test_a_samplers_attributes_are_the_spans_as_in_the_sdk():
    tracer, exporter = _tracer(sampler=_Tagging())
    tracer.start_span("s", attributes={"a": 1}).end()
    [span] = exporter.get_finished_spans()
    assert dict(span.attributes) == {"sampled.by": "tagging", "a": 0}


@pytest.mark.parametrize(
    "sampler",
    [
        None,  # the SDK's default: parent-based, always on at the root (DEFAULT_ON)
        DEFAULT_OFF,
        ParentBasedTraceIdRatio(0.5),
        ParentBased(TraceIdRatioBased(0.5)),
        ParentBased(ALWAYS_ON, local_parent_sampled=ALWAYS_OFF),  # a child is asked about
        TraceIdRatioBased(0.5),
    ],
    ids=[
        "default",
        "parent-based off",
        "parent-based ratio (the SDK's class)",
        "parent-based ratio",
        "parent-based, children off",
        "ratio",
    ],
)
def test_decisions_and_flags_are_the_sdks(sampler):
    """Children of sampled and unsampled, local and remote parents: the same decisions and trace flags as the
    SDK's spans (a child of the SDK's own parent-based samplers follows its parent without asking them)."""
    provider = TracerProvider(sampler=sampler, id_generator=_Ids())
    sdk, lean = provider.get_tracer("pipeline"), Tracer.of(provider, "pipeline")
    assert lean is not None
    parents = [
        None,
        NonRecordingSpan(REMOTE),
        NonRecordingSpan(SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(0))),
        NonRecordingSpan(
            SpanContext(0x5, 0x6, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED | 2))
        ),
        NonRecordingSpan(SpanContext(0x5, 0x6, is_remote=False, trace_flags=TraceFlags(0))),
    ]
    for parent in parents:
        context = set_span_in_context(parent) if parent is not None else None
        for trace_id in (0x1, 0xFFFFFFFFFFFFFFFF0000000000000000):
            _Ids.trace_id = trace_id
            theirs = sdk.start_span("s", context=context)
            ours = lean.start_span("s", context=context)
            assert ours.is_recording() == theirs.is_recording()
            assert ours.get_span_context().trace_flags == theirs.get_span_context().trace_flags
            assert ours.get_span_context().trace_id == theirs.get_span_context().trace_id
            assert ours.get_span_context().trace_state == theirs.get_span_context().trace_state


class _Ids(RandomIdGenerator):
    trace_id = 1

    def generate_trace_id(self) -> int:
        return self.trace_id


def test_an_exception_leaving_the_block_is_recorded_and_fails_the_span():
    tracer, exporter = _tracer()
    with pytest.raises(ValueError), tracer.start_as_current_span("failing"):
        raise ValueError("boom")
    with pytest.raises(KeyError), tracer.start_as_current_span("quiet", record_exception=False):
        raise KeyError("k")
    with (
        pytest.raises(RuntimeError),
        tracer.start_as_current_span("unset", record_exception=False, set_status_on_exception=False),
    ):
        raise RuntimeError("r")
    # Not an error (as the SDK has it): a cancellation ends the span, unmarked.
    with pytest.raises(asyncio.CancelledError), tracer.start_as_current_span("cancelled"):
        raise asyncio.CancelledError
    spans = {span.name: span for span in exporter.get_finished_spans()}
    failing = spans["failing"]
    assert failing.status.status_code == StatusCode.ERROR
    assert failing.status.description == "ValueError: boom"
    [event] = failing.events
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "boom"
    assert "raise ValueError" in event.attributes["exception.stacktrace"]
    assert spans["quiet"].status.status_code == StatusCode.ERROR and not spans["quiet"].events
    assert spans["unset"].status.status_code == StatusCode.UNSET and not spans["unset"].events
    assert spans["cancelled"].status.status_code == StatusCode.UNSET and not spans["cancelled"].events


def test_status_ok_is_final_and_unset_changes_nothing():
    tracer, exporter = _tracer()
    span = tracer.start_span("s")
    span.set_status(StatusCode.ERROR, "bad")
    span.set_status(Status(StatusCode.UNSET))
    assert span.status.status_code == StatusCode.ERROR  # type: ignore[attr-defined]
    span.set_status(Status(StatusCode.OK))
    span.set_status(StatusCode.ERROR, "late")
    span.end()
    [done] = exporter.get_finished_spans()
    assert done.status.status_code == StatusCode.OK


def test_limits_drop_and_count():
    tracer, exporter = _tracer(limits=SpanLimits(max_span_attributes=2, max_events=1, max_links=1))
    other = SpanContext(0x1, 0x2, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    span = tracer.start_span("s", attributes={"a": 1, "b": 2, "c": 3}, links=[Link(REMOTE), Link(other)])
    span.set_attribute("a", 10)  # an existing key is replaced, not dropped
    span.set_attributes({"d": 4})
    span.add_event("one")
    span.add_event("two")
    span.add_link(other)
    span.end()
    [done] = exporter.get_finished_spans()
    assert dict(done.attributes) == {"a": 10, "b": 2}
    assert (done.dropped_attributes, done.dropped_events, done.dropped_links) == (2, 1, 2)
    assert [event.name for event in done.events] == ["one"] and [link.context for link in done.links] == [
        REMOTE
    ]


def test_an_ended_span_changes_no_more(caplog):
    tracer, exporter = _tracer()
    span = tracer.start_span("s")
    span.end()
    assert not span.is_recording()
    span.set_attribute("late", 1)
    span.add_event("late")
    span.update_name("renamed")
    with caplog.at_level(logging.WARNING, logger="pipeline.runtime.spans"):
        span.end()
    [done] = exporter.get_finished_spans()
    assert done.name == "s" and not done.attributes and not done.events
    assert "ended twice" in caplog.text


def test_an_sdk_provider_disabled_by_the_environment_means_no_tracing(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    telemetry = Telemetry(TracerProvider())
    assert not telemetry.enabled and telemetry.tracer is None


class _Stamp(SpanProcessor):
    """Adds an attribute at each span's start, as a processor that copies baggage into spans does."""

    def __init__(self) -> None:
        self.parents: list[SpanContext] = []

    def on_start(self, span, parent_context=None) -> None:
        span.set_attribute("stamped", span.name)
        self.parents.append(trace.get_current_span(parent_context).get_span_context())


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "sdk"])
def test_a_processor_hears_of_each_span_at_its_start(lean):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = Tracer.of(provider, "pipeline") if lean else provider.get_tracer("pipeline")
    assert tracer is not None
    with tracer.start_as_current_span("before"):
        pass
    stamp = _Stamp()
    provider.add_span_processor(stamp)  # added after the tracer was made: it hears of the next span
    with tracer.start_as_current_span("after", context=set_span_in_context(NonRecordingSpan(REMOTE))):
        pass
    finished = {span.name: span for span in exporter.get_finished_spans()}
    assert "stamped" not in finished["before"].attributes
    assert finished["after"].attributes["stamped"] == "after"
    assert stamp.parents == [REMOTE]


def test_limits_from_the_environment_as_the_sdks_provider_reads_them(monkeypatch):
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "1")
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "0")
    tracer, exporter = _tracer()
    span = tracer.start_span("s", attributes={"a": 1, "b": 2})
    span.add_event("dropped")
    span.end()
    [done] = exporter.get_finished_spans()
    assert dict(done.attributes) == {"a": 1}
    assert (done.dropped_attributes, done.dropped_events, list(done.events)) == (1, 1, [])


def test_an_ended_span_reaches_processors_as_the_sdks_readable_span():
    """What processors and exporters get is the SDK's own `ReadableSpan`, made through its constructor: every
    property and `to_json` (the console exporter's) read as the SDK's spans do."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = Tracer.of(provider, "pipeline", "1.2", "https://opentelemetry.io/schemas/1.11.0")
    assert tracer is not None
    parent = set_span_in_context(NonRecordingSpan(REMOTE))
    with tracer.start_as_current_span("s", context=parent, attributes={"a": 1}) as span:
        span.set_status(Status(StatusCode.ERROR, "no"))
        span.add_event("e", {"k": "v"})
    [done] = exporter.get_finished_spans()
    assert isinstance(done, ReadableSpan) and not isinstance(done, trace.Span)
    assert (done.name, dict(done.attributes), done.status.description) == ("s", {"a": 1}, "no")
    assert done.parent == REMOTE and done.kind == SpanKind.INTERNAL
    assert done.start_time is not None and done.end_time is not None and done.start_time <= done.end_time
    assert done.resource is provider.resource
    scope = done.instrumentation_scope
    assert scope is not None
    assert (scope.name, scope.version, scope.schema_url) == (
        "pipeline",
        "1.2",
        "https://opentelemetry.io/schemas/1.11.0",
    )
    record = json.loads(done.to_json())
    assert record["name"] == "s" and record["status"] == {"status_code": "ERROR", "description": "no"}
    assert record["events"][0]["attributes"] == {"k": "v"} and record["attributes"] == {"a": 1}


def test_the_span_bench_measures_both_tracers(capsys):
    """`python -m bench.spans` runs both tracers on a request's spans and prints a figure for each (the
    figures themselves are not checked)."""
    from bench import spans

    assert spans.main(["--requests", "20", "--rounds", "1"]) == 0
    printed = capsys.readouterr().out
    assert "pipeline:" in printed and "sdk:" in printed and printed.count("µs of CPU per span") == 2

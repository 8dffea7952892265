"""The OTLP encoder gives the SDK's own encoder's request, field by field, for every kind of span content, for
the SDK's spans and this project's (`pipeline.runtime.spans`)."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from pipeline.runtime import otlp
from pipeline.runtime.otlp import encode_spans
from pipeline.runtime.spans import Tracer

REMOTE = SpanContext(
    0x4BF92F3577B34DA6A3CE929D0E0E4736,
    0x00F067AA0BA902B7,
    is_remote=True,
    trace_flags=TraceFlags(TraceFlags.SAMPLED),
    trace_state=TraceState([("vendor", "value"), ("other", "x")]),
)


def _spans(lean: bool = False) -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "test", "deployment": "a"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    schema = "https://opentelemetry.io/schemas/1.11.0"
    tracer: trace.Tracer | None = provider.get_tracer("pipeline", "1.0", schema_url=schema)
    other: trace.Tracer | None = provider.get_tracer("other")
    if lean:
        tracer, other = Tracer.of(provider, "pipeline", "1.0", schema), Tracer.of(provider, "other")
    assert tracer is not None and other is not None
    with tracer.start_as_current_span(
        "ModelInfer refcnn",
        context=set_span_in_context(NonRecordingSpan(REMOTE)),
        kind=SpanKind.SERVER,
        attributes={"s": "text", "i": 7, "f": 0.5, "b": True, "ints": [1, 2], "strs": ["a", "b"], "e": []},
    ) as root:
        with tracer.start_as_current_span("step a", attributes={"pipeline.step": 0}) as step:
            step.add_event("dispatched", {"size": 4})
            step.add_event("bare")
        batch = tracer.start_span(
            "batch a",
            kind=SpanKind.CLIENT,
            links=[Link(step.get_span_context(), {"pipeline.link": "batch"}), Link(REMOTE)],
        )
        batch.set_status(Status(StatusCode.ERROR, "stage failed"))
        batch.end()
        other.start_span("other scope", kind=SpanKind.PRODUCER).end()
        root.set_status(Status(StatusCode.OK))
    return list(exporter.get_finished_spans())


@pytest.mark.parametrize("lean", [False, True], ids=["sdk spans", "lean spans"])
def test_the_request_equals_the_sdk_encoders(lean):
    spans = _spans(lean)
    ours, theirs = encode_spans(spans), sdk_encode_spans(spans)
    assert ours == theirs
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
    # Two instrumentation scopes under the one resource.
    [resource_spans] = ours.resource_spans
    assert [len(scope.spans) for scope in resource_spans.scope_spans] == [3, 1]


def test_values_the_sdk_checks_away_are_encoded_as_its_encoder_does():
    # Resources and hand-made spans may hold what span attributes may not: maps, None, bytes.
    [span] = _spans()[:1]
    made = ReadableSpan(
        "made",
        context=span.context,
        resource=span.resource,
        attributes={"map": {"k": 1, "n": {"deep": "x"}}, "none": None, "raw": b"\x00\x01"},
        kind=SpanKind.INTERNAL,
        instrumentation_scope=None,
        start_time=1,
        end_time=2,
    )
    assert encode_spans([made]) == sdk_encode_spans([made])


def test_an_attribute_otlp_cannot_carry_is_left_out():
    [span] = _spans()[:1]
    made = ReadableSpan(
        "made",
        context=span.context,
        resource=span.resource,
        attributes={"good": 1, "bad": object()},
        start_time=1,
        end_time=2,
    )
    [kept] = encode_spans([made]).resource_spans[0].scope_spans[0].spans[0].attributes
    assert kept.key == "good" and kept.value.int_value == 1


def test_attributes_serialized_once_and_those_that_are_not_encode_alike(monkeypatch):
    # A key with more distinct values than are kept serialized (a request id), a long string, values equal
    # across types (True, 1, 1.0) that must not share a serialized piece, and names that never repeat.
    [span] = _spans()[:1]
    made = [
        ReadableSpan(
            f"made {i % 3}" if i % 2 else f"response {i}",
            context=span.context,
            resource=span.resource,
            attributes={
                "id": str(i),
                "model": "m",
                "long": "x" * 1000,
                "n": (True, 1, 1.0)[i % 3],
                "i": i % 2,
            },
            start_time=i,
            end_time=i + 1,
        )
        for i in range(200)
    ]
    monkeypatch.setattr(otlp, "_MAX_HEADS", 16)  # the serialized heads are emptied as they fill
    assert encode_spans(made) == sdk_encode_spans(made)
    assert encode_spans(made) == sdk_encode_spans(made)  # the second time from what was kept
    assert len(otlp._HEADS) <= 16

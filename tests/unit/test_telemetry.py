"""Tracing configuration from the environment, the JSON-lines exporter, and `pipeline trace`."""

from __future__ import annotations

import json

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import Link, SpanKind, set_span_in_context

from pipeline.cli import main
from pipeline.runtime.settings_values import port_or_off as metrics_port
from pipeline.runtime.telemetry import (
    NO_SPAN,
    JsonLinesSpanExporter,
    Telemetry,
    _exporter,
    service_name,
    tracer_provider_from_env,
)


def test_tracing_is_off_unless_the_environment_asks(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert tracer_provider_from_env("router") is None
    assert tracer_provider_from_env("router", {"OTEL_TRACES_EXPORTER": "none"}) is None
    off = Telemetry.from_env("router", {})
    assert not off.enabled
    # Off, every helper is the one shared no-op and metadata passes untouched.
    assert off.span("x") is NO_SPAN and off.server_span("x", (), {}) is NO_SPAN
    metadata = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
    assert off.inject(metadata) is metadata
    assert off.current_span() is None


def test_exporters_follow_the_standard_variables():
    assert isinstance(_exporter("otlp", {}), GrpcExporter)
    assert isinstance(_exporter("otlp", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}), HttpExporter)
    assert isinstance(_exporter("otlp", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}), GrpcExporter)
    with pytest.raises(ValueError, match="protocol"):
        _exporter("otlp", {"OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"})
    with pytest.raises(ValueError, match="unknown exporter"):
        _exporter("zipkin-ish", {})


def test_service_names_take_otel_service_name_as_prefix(monkeypatch, tmp_path):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert service_name("router") == "pipeline-router"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "shop")
    assert service_name("preprocess") == "shop-preprocess"
    # The sampler is the SDK's own reading of OTEL_TRACES_SAMPLER.
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    provider = tracer_provider_from_env(
        "model", {"OTEL_TRACES_EXPORTER": "jsonl", "PIPELINE_TRACE_FILE": str(tmp_path / "t.jsonl")}
    )
    assert provider is not None
    assert provider.sampler is ALWAYS_OFF
    assert provider.resource.attributes["service.name"] == "shop-model"
    provider.shutdown()


def test_metrics_port_values():
    assert metrics_port("8002") == 8002
    assert metrics_port("0") == 0
    assert metrics_port("off") is None
    assert metrics_port("-1") is None


def _write_trace(path):
    """Two requests whose steps rode in one batch (in the first request's trace, linked to both steps), as the
    router makes them."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    tracer = provider.get_tracer("test")
    t = 1_000_000_000
    first = tracer.start_span("ModelInfer chain", kind=SpanKind.SERVER, start_time=t)
    second = tracer.start_span("ModelInfer chain", kind=SpanKind.SERVER, start_time=t + 100_000)
    steps = [
        tracer.start_span("step shift", context=set_span_in_context(root), start_time=t + 200_000)
        for root in (first, second)
    ]
    batch = tracer.start_span(
        "batch shift",
        context=set_span_in_context(steps[0]),
        links=[Link(s.get_span_context()) for s in steps],
        attributes={"pipeline.batch.size": 2},
        start_time=t + 300_000,
    )
    batch.end(end_time=t + 2_000_000)
    for step in steps:
        step.end(end_time=t + 2_100_000)
    first.end(end_time=t + 2_500_000)
    second.end(end_time=t + 2_600_000)
    provider.shutdown()
    return f"{first.get_span_context().trace_id:032x}", f"{second.get_span_context().trace_id:032x}"


def test_pipeline_trace_prints_a_waterfall_with_the_linked_batch(tmp_path, capsys):
    path = tmp_path / "traces.jsonl"
    first, second = _write_trace(path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 5 and all(r["start_ns"] <= r["end_ns"] for r in records)

    assert main(["trace", str(path), "--trace-id", second[:12]]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert second in lines[0] and "3 spans" in lines[0]
    names = [line.rsplit("| ", 1)[1] for line in lines[2:]]
    # Indentation follows parent and child; the batch of the other trace shows beneath the linking step.
    assert names[0].startswith("ModelInfer chain")
    assert names[1].startswith("  step shift") and "batch=2" not in names[1]
    assert names[2].startswith("    ↗ batch shift") and "batch=2" in names[2]

    assert main(["trace", str(path), "--last", "--png", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert second in out.splitlines()[0]  # the request that started last
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"

    assert main(["trace", str(path), "--trace-id", first]) == 0
    assert "3 spans" in capsys.readouterr().out.splitlines()[0]
    assert main(["trace", str(path), "--trace-id", "ffff"]) == 1


def test_pipeline_trace_marks_skipped_steps_and_cache_hits(tmp_path, capsys):
    path = tmp_path / "traces.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    tracer = provider.get_tracer("test")
    root = tracer.start_span("ModelInfer gated", attributes={"pipeline.cache.hit": False}, start_time=1000)
    step = tracer.start_span(
        "step digits_cnn",
        context=set_span_in_context(root),
        attributes={"pipeline.step.skipped": True, "pipeline.step.skip_reason": "condition not met"},
        start_time=2000,
    )
    step.end(end_time=3000)
    root.end(end_time=5000)
    provider.shutdown()
    assert main(["trace", str(path), "--last"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("step digits_cnn" in line and "skipped=condition not met" in line for line in lines)
    assert any("ModelInfer gated" in line and "cache hit=False" in line for line in lines)

"""What a traced request's spans cost, this project's (`pipeline.runtime.spans`) against the OpenTelemetry
SDK's: `python -m bench.spans [--requests 10000] [--rounds 5]`.

Each request makes what a router makes for a request through a three-step ensemble: a server span continuing
a remote parent, a child span per step made current and ended, and a span recorded with given times (a
batch's queue), five in all, with the attributes the router sets, every one handed to a batch span
processor (whose exporter drops them: the export's own cost is `pipeline.runtime.otlp`'s). It prints the CPU
per span of each tracer, round by round (the two take turns), and the smallest of the rounds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, set_span_in_context

from pipeline.runtime.spans import Tracer

#: The spans one request makes here.
SPANS_PER_REQUEST = 5
#: The caller's span, as a request's `traceparent` carries it.
REMOTE = set_span_in_context(
    NonRecordingSpan(SpanContext(0xABC, 0xDEF, True, TraceFlags(TraceFlags.SAMPLED)))
)


class _Dropped(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _request(tracer: trace.Tracer) -> None:
    with tracer.start_as_current_span(
        "ModelInfer ensemble",
        context=REMOTE,
        kind=SpanKind.SERVER,
        attributes={"pipeline.model": "ensemble", "pipeline.request_id": "1"},
        record_exception=False,
        set_status_on_exception=False,
    ):
        for step in range(3):
            with tracer.start_as_current_span("step", attributes={"pipeline.step": step}):
                pass
        tracer.start_span("queue", start_time=1).end(end_time=2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spans", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="requests per tracer and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the tracers taking turns")
    args = parser.parse_args(argv)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Dropped(), max_queue_size=1 << 20))
    lean = Tracer.of(provider, "pipeline")
    assert lean is not None
    tracers: dict[str, trace.Tracer] = {"pipeline": lean, "sdk": provider.get_tracer("pipeline")}
    figures: dict[str, list[float]] = {name: [] for name in tracers}
    for _ in range(args.rounds):
        for name, tracer in tracers.items():
            started = time.process_time()
            for _ in range(args.requests):
                _request(tracer)
            spent = time.process_time() - started
            figures[name].append(spent / (args.requests * SPANS_PER_REQUEST) * 1e6)
    for name, each in figures.items():
        rounds = " ".join(f"{us:.1f}" for us in each)
        print(f"{name:>8}: {min(each):5.2f} µs of CPU per span (rounds: {rounds})")
    provider.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

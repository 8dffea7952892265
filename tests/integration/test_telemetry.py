"""Tracing, metrics and statistics through real in-process servers: the router and two stage servers.

Each server gets its own tracer provider (as each process has its own) with an in-memory exporter behind a
`SimpleSpanProcessor`, so a span is exported the moment it ends; assertions read the exporters after
`force_flush`. Batches are formed deterministically: the batched step has `idle_dispatch: false`, a
delay of 30 s and a size that the concurrent requests fill exactly.
"""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.telemetry import Telemetry
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.stages import Scale

BATCH = 3


class Shift(Stage):
    """Z = Y + 1 (batched by the router)."""

    name = "shift"
    max_batch_size = 16
    inputs = (TensorSpec("Y", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Z", "FP32", (-1, 3)),)

    def infer(self, inputs):
        return {"Z": inputs["Y"] + 1}


ENSEMBLE = """
name: chain
stages:
  a: {{address: "{a}"}}
  b:
    address: "{b}"
    dynamic_batching: {{max_batch_size: {batch}, max_queue_delay_microseconds: 30000000, idle_dispatch: false}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Z, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: scale, stage: a, input_map: {{X: X}}, output_map: {{Y: y}}}}
  - {{model_name: shift, stage: b, input_map: {{Y: y}}, output_map: {{Z: Z}}}}
"""


class Traced:
    """A tracer provider per server, as each process would have, with its spans kept in memory."""

    def __init__(self, service: str) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.telemetry = Telemetry(self.provider)
        self.metrics = Metrics()

    def spans(self) -> list[ReadableSpan]:
        self.provider.force_flush()
        return list(self.exporter.get_finished_spans())


class Served:
    def __init__(self, router: str, a: str, b: str, traced: dict[str, Traced]) -> None:
        self.router, self.a, self.b, self.traced = router, a, b, traced

    def clear(self) -> None:
        for t in self.traced.values():
            t.exporter.clear()

    def all_spans(self) -> list[ReadableSpan]:
        return [s for t in self.traced.values() for s in t.spans()]


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    traced = {name: Traced(f"pipeline-{name}") for name in ("router", "a", "b")}
    async with (
        serving_stages(
            [Scale(max_batch_size=16)],
            telemetry=traced["a"].telemetry,
            metrics=traced["a"].metrics,
            metrics_port=0,
        ) as a,
        serving_stages(
            [Shift()], telemetry=traced["b"].telemetry, metrics=traced["b"].metrics, metrics_port=0
        ) as b,
    ):
        folder = tmp_path_factory.mktemp("telemetry")
        (folder / "chain.yaml").write_text(ENSEMBLE.format(a=a.address, b=b.address, batch=BATCH))
        r = traced["router"]
        async with serving_router(
            load_ensembles([folder]), telemetry=r.telemetry, metrics=r.metrics, metrics_port=0
        ) as router:
            await wait_serving(router.address)
            await wait_serving(a.address)
            await wait_serving(b.address)
            yield Served(router.address, a.address, b.address, traced)


def _x(rows: int = 1, value: float = 1.0) -> np.ndarray:
    return np.full((rows, 3), value, dtype=np.float32)


async def _send_batch(stub, ids: list[str], metadata=None) -> list[pb.ModelInferResponse]:
    """BATCH concurrent requests: together they fill exactly one batch of the `shift` step."""
    assert len(ids) == BATCH
    calls = [stub.ModelInfer(request_for("chain", i, X=_x()), metadata=metadata, timeout=30) for i in ids]
    return await asyncio.gather(*calls)


def _named(spans, prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


async def test_one_trace_per_request_across_processes_with_the_batch_linked(served):
    served.clear()
    ids = ["r0", "r1", "r2"]
    async with inference_stub(served.router) as stub:
        await _send_batch(stub, ids)
    router = served.traced["router"].spans()
    a = served.traced["a"].spans()
    b = served.traced["b"].spans()

    # One server span per request, each the root of its own trace.
    roots = [s for s in router if s.kind == SpanKind.SERVER]
    assert sorted(s.attributes["pipeline.request_id"] for s in roots) == ids
    assert all(s.parent is None for s in roots)
    traces = {s.context.trace_id for s in roots}
    assert len(traces) == BATCH
    by_id = {s.context.span_id: s for s in router}
    assert {s.context.trace_id for s in (*router, *a, *b)} == traces

    # Unbatched step: router step span -> stage call (CLIENT) -> the stage's server span (via metadata).
    for root in roots:
        trace_id = root.context.trace_id
        step = next(s for s in _named(router, "step scale") if s.context.trace_id == trace_id)
        assert step.parent.span_id == root.context.span_id
        assert step.attributes["pipeline.model"] == "scale" and step.attributes["pipeline.step"] == 0
        call = next(
            s for s in router if s.kind == SpanKind.CLIENT and s.parent.span_id == step.context.span_id
        )
        assert call.attributes["server.address"] == served.a
        stage_server = next(s for s in a if s.kind == SpanKind.SERVER and s.context.trace_id == trace_id)
        assert stage_server.parent.span_id == call.context.span_id and stage_server.parent.is_remote
        assert stage_server.resource.attributes["service.name"] == "pipeline-a"
        inner = {s.name for s in a if s.parent and s.parent.span_id == stage_server.context.span_id}
        assert inner == {"compute"}

    # Batched step: one batch span, a child of one member's step, linked to every member's step span.
    [batch] = _named(router, "batch shift")
    steps = _named(router, "step shift")
    assert len(steps) == BATCH
    assert batch.attributes["pipeline.batch.size"] == BATCH
    assert batch.attributes["pipeline.stage"] == "b"
    assert {link.context.span_id for link in batch.links} == {s.context.span_id for s in steps}
    assert batch.parent.span_id in {s.context.span_id for s in steps}
    for step in steps:
        # Each member's step says how large its batch was, and the batch links to it (the first member's
        # trace holds the batch span itself). Its queue wait ends as the batch starts.
        assert step.attributes["pipeline.batch.size"] == BATCH
        assert by_id[step.parent.span_id].kind == SpanKind.SERVER
        assert step.start_time <= batch.start_time <= batch.end_time <= step.end_time
        assert not step.links
    # The stage continued the batch span's context: one stage call, one server span under the batch.
    [stage_server] = [s for s in b if s.kind == SpanKind.SERVER]
    assert stage_server.parent.span_id == batch.context.span_id
    assert stage_server.attributes["pipeline.batch.size"] == BATCH


async def test_a_clients_traceparent_is_continued(served):
    served.clear()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    metadata = (("traceparent", f"00-{trace_id}-{parent_id}-01"),)
    async with inference_stub(served.router) as stub:
        await _send_batch(stub, ["t0", "t1", "t2"], metadata=metadata)
    spans = served.all_spans()
    roots = [s for s in served.traced["router"].spans() if s.kind == SpanKind.SERVER]
    assert len(roots) == BATCH
    for root in roots:
        assert f"{root.context.trace_id:032x}" == trace_id
        assert f"{root.parent.span_id:016x}" == parent_id and root.parent.is_remote
    assert {f"{s.context.trace_id:032x}" for s in spans} == {trace_id}


async def test_an_error_is_recorded_on_the_spans(served):
    served.clear()
    async with inference_stub(served.router) as stub:
        err = await rpc_error(stub.ModelInfer(request_for("chain", "bad", X=_x(value=-1.0)), timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    [root] = [s for s in served.traced["router"].spans() if s.kind == SpanKind.SERVER]
    assert root.status.status_code == StatusCode.ERROR
    assert "negative values" in root.status.description
    assert root.attributes["rpc.grpc.status_code"] == "INVALID_ARGUMENT"
    assert any(e.name == "exception" for e in root.events)
    [stage_server] = [s for s in served.traced["a"].spans() if s.kind == SpanKind.SERVER]
    assert stage_server.status.status_code == StatusCode.ERROR
    # The model refused the input: its server span holds the error, and no compute span was recorded.
    assert not [s for s in served.traced["a"].spans() if s.name == "compute"]


def _scrape(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def _statistics(address: str, model: str) -> pb.ModelStatistics:
    async with inference_stub(address) as stub:
        return (await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))).model_stats[0]


async def test_metrics_and_statistics_count_the_requests_sent(served):
    router_metrics = served.traced["router"].metrics
    a_metrics, b_metrics = served.traced["a"].metrics, served.traced["b"].metrics
    before = await asyncio.to_thread(_scrape, router_metrics)
    before_a = await asyncio.to_thread(_scrape, a_metrics)
    before_b = await asyncio.to_thread(_scrape, b_metrics)
    stats_before = {
        "chain": await _statistics(served.router, "chain"),
        "scale@router": await _statistics(served.router, "scale"),
        "shift@router": await _statistics(served.router, "shift"),
        "scale": await _statistics(served.a, "scale"),
        "shift": await _statistics(served.b, "shift"),
    }
    rounds = 2
    async with inference_stub(served.router) as stub:
        for n in range(rounds):
            await _send_batch(stub, [f"m{n}-{i}" for i in range(BATCH)])
        await rpc_error(stub.ModelInfer(request_for("chain", "bad", X=_x(value=-1.0)), timeout=30))
        await rpc_error(stub.ModelInfer(request_for("nope", "x", X=_x()), timeout=30))
    after = await asyncio.to_thread(_scrape, router_metrics)
    after_a = await asyncio.to_thread(_scrape, a_metrics)
    after_b = await asyncio.to_thread(_scrape, b_metrics)

    def delta(new, old, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return new.get(key, 0.0) - old.get(key, 0.0)

    sent = rounds * BATCH
    assert delta(after, before, "pipeline_requests_total", model="chain", outcome="OK") == sent
    assert delta(after, before, "pipeline_requests_total", model="chain", outcome="INVALID_ARGUMENT") == 1
    assert delta(after, before, "pipeline_requests_total", model="", outcome="NOT_FOUND") == 1
    assert delta(after, before, "pipeline_request_duration_seconds_count", model="chain") == sent
    # The batched step: `rounds` batches of BATCH, each request's queue wait observed once.
    assert delta(after, before, "pipeline_batch_size_count", model="shift") == rounds
    assert delta(after, before, "pipeline_batch_size_sum", model="shift") == sent
    assert delta(after, before, "pipeline_queue_duration_seconds_count", model="shift") == sent
    assert delta(after, before, "pipeline_stage_calls_total", stage="b", outcome="OK") == rounds
    assert delta(after, before, "pipeline_stage_calls_total", stage="a", outcome="OK") == sent
    assert after[("pipeline_stage_healthy", (("stage", "a"),))] == 1.0
    assert after[("pipeline_queue_depth", (("model", "shift"),))] == 0.0
    assert after[("pipeline_inflight_batches", (("model", "shift"),))] == 0.0
    # The stages count what they were sent: every request at `a`, one call per batch at `b`.
    assert delta(after_a, before_a, "pipeline_requests_total", model="scale", outcome="OK") == sent
    assert delta(after_a, before_a, "pipeline_requests_total", model="scale", outcome="INVALID_ARGUMENT") == 1
    assert delta(after_b, before_b, "pipeline_requests_total", model="shift", outcome="OK") == rounds
    assert delta(after_b, before_b, "pipeline_batch_size_sum", model="shift") == sent
    assert delta(after_b, before_b, "pipeline_compute_duration_seconds_count", model="shift") == rounds

    # Triton's statistics: inference_count = items, execution_count = executions, per model and place.
    stats_after = {
        "chain": await _statistics(served.router, "chain"),
        "scale@router": await _statistics(served.router, "scale"),
        "shift@router": await _statistics(served.router, "shift"),
        "scale": await _statistics(served.a, "scale"),
        "shift": await _statistics(served.b, "shift"),
    }
    expected = {  # (inferences, executions, successes, failures)
        "chain": (sent, sent, sent, 1),
        "scale@router": (sent, sent, sent, 1),
        "shift@router": (sent, rounds, sent, 0),
        "scale": (sent, sent, sent, 1),
        "shift": (sent, rounds, rounds, 0),
    }
    for name, (inferences, executions, successes, failures) in expected.items():
        new, old = stats_after[name], stats_before[name]
        got = (
            new.inference_count - old.inference_count,
            new.execution_count - old.execution_count,
            new.inference_stats.success.count - old.inference_stats.success.count,
            new.inference_stats.fail.count - old.inference_stats.fail.count,
        )
        assert got == (inferences, executions, successes, failures), name
        assert new.inference_stats.success.ns > old.inference_stats.success.ns
        assert new.inference_stats.compute_infer.ns > old.inference_stats.compute_infer.ns
    # A stage's compute is its model's run: never more than the whole request.
    shift = stats_after["shift"].inference_stats
    assert 0 < shift.compute_infer.ns <= shift.success.ns
    assert shift.compute_input.count == shift.success.count


async def test_a_stage_model_called_directly_is_counted_as_a_steps_call(served):
    """A client's call of an unbatched stage model takes the path of a step's call: the model's
    statistics, and its batch-size and compute-duration metrics, count it (one execution of its items)."""
    router_metrics = served.traced["router"].metrics
    before = await asyncio.to_thread(_scrape, router_metrics)
    stats_before = await _statistics(served.router, "scale")
    async with inference_stub(served.router) as stub:
        await stub.ModelInfer(request_for("scale", "direct", X=_x(rows=2)), timeout=30)
    after = await asyncio.to_thread(_scrape, router_metrics)
    stats_after = await _statistics(served.router, "scale")

    def delta(name: str) -> float:
        key = (name, (("model", "scale"),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("pipeline_batch_size_count") == 1
    assert delta("pipeline_batch_size_sum") == 2
    assert delta("pipeline_compute_duration_seconds_count") == 1
    assert stats_after.inference_count - stats_before.inference_count == 2
    assert stats_after.execution_count - stats_before.execution_count == 1

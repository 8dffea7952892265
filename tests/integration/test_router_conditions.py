"""Conditional steps through real servers: which steps run, what the stages see, statistics and traces."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.telemetry import Telemetry
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving

VEC = (-1, 4)


class Gauge(Stage):
    """SCORE = the sum of each row: the cheap check the conditions read."""

    name = "gauge"
    max_batch_size = 16
    inputs = (TensorSpec("X", "FP32", VEC),)
    outputs = (TensorSpec("SCORE", "FP32", (-1, 1)),)

    def infer(self, inputs):
        return {"SCORE": inputs["X"].sum(axis=1, keepdims=True)}


class Times(Stage):
    """Y = factor * X."""

    max_batch_size = 16
    inputs = (TensorSpec("X", "FP32", VEC),)
    outputs = (TensorSpec("Y", "FP32", VEC),)

    def __init__(self, name: str, factor: float) -> None:
        self.name = name
        self.factor = factor

    def infer(self, inputs):
        return {"Y": inputs["X"] * self.factor}


ENSEMBLES = {
    # A comparison and its complement: requests with a positive sum go to the batched `heavy`, the others
    # to `light`; Y has one producer per branch.
    "cond": """
name: cond
stages:
  s: {{address: "{address}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 4]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 4]}}]
steps:
  - {{model_name: gauge, stage: s, input_map: {{X: X}}, output_map: {{SCORE: score}}}}
  - model_name: heavy
    stage: s
    when: {{tensor: score, greater_than: 0}}
    input_map: {{X: X}}
    output_map: {{Y: Y}}
    dynamic_batching: {{max_batch_size: 3, max_queue_delay_microseconds: 30000000, idle_dispatch: false}}
  - {{model_name: light, stage: s, when: {{tensor: score, less_equal: 0}}, input_map: {{X: X}}, output_map: {{Y: Y}}}}
""",
    # A switch on a string the request carries, with a default; the fr branch goes on through two more steps,
    # which the other branches skip because their input is never produced; Z exists on the fr path only.
    "routed": """
name: routed
stages:
  s: {{address: "{address}"}}
inputs: [{{name: LANG, datatype: BYTES, shape: [-1, 1]}}, {{name: X, datatype: FP32, shape: [-1, 4]}}]
outputs:
  - {{name: Y, datatype: FP32, shape: [-1, 4]}}
  - {{name: Z, datatype: FP32, shape: [-1, 4], optional: true}}
switches:
  lang:
    tensor: LANG
    cases: [{{name: en, equals: en}}, {{name: fr, equals: fr}}]
steps:
  - {{model_name: times2, stage: s, when: {{switch: lang, case: en}}, input_map: {{X: X}}, output_map: {{Y: Y}}}}
  - {{model_name: times3, stage: s, when: {{switch: lang, case: fr}}, input_map: {{X: X}}, output_map: {{Y: fr}}}}
  - {{model_name: times5, stage: s, when: {{switch: lang, case: default}}, input_map: {{X: X}}, output_map: {{Y: Y}}}}
  - {{model_name: times7, stage: s, input_map: {{X: fr}}, output_map: {{Y: Y}}}}
  - {{model_name: times11, stage: s, input_map: {{X: fr}}, output_map: {{Y: Z}}}}
""",
}


class Served:
    def __init__(self, router: str, stage: str, exporter: InMemorySpanExporter, metrics: Metrics) -> None:
        self.router, self.stage, self.exporter, self.metrics = router, stage, exporter, metrics

    def branch_count(self, ensemble: str, step: str, taken: str) -> float:
        labels = {"ensemble": ensemble, "step": step, "taken": taken}
        return self.metrics.registry.get_sample_value("pipeline_branch_requests_total", labels) or 0.0


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("conditions")
    stages = [Gauge(), Times("heavy", 10), Times("light", -1)]
    stages += [Times(f"times{n}", n) for n in (2, 3, 5, 7, 11)]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = Metrics()
    async with serving_stages(stages) as stage:
        for name, text in ENSEMBLES.items():
            (folder / f"{name}.yaml").write_text(text.format(address=stage.address))
        async with serving_router(
            load_ensembles(folder), telemetry=Telemetry(provider), metrics=metrics
        ) as router:
            await wait_serving(router.address)
            yield Served(router.address, stage.address, exporter, metrics)


async def stage_stats(address: str, model: str) -> pb.ModelStatistics:
    async with inference_stub(address) as stub:
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))
    return reply.model_stats[0]


def lang(text: str) -> np.ndarray:
    return np.array([[text.encode()]], dtype=object)


async def test_true_and_false_conditions_pick_the_branch(served):
    up, down = np.ones((1, 4), np.float32), -np.ones((1, 4), np.float32)
    light_before = (await stage_stats(served.stage, "light")).inference_count
    async with inference_stub(served.router) as stub:
        # `heavy` batches by three and waits for a full batch: send it three requests.
        replies = await asyncio.gather(
            *(stub.ModelInfer(request_for("cond", X=up * (i + 1)), timeout=20) for i in range(3)),
            stub.ModelInfer(request_for("cond", X=down), timeout=20),
        )
    for i in range(3):
        np.testing.assert_array_equal(response_tensors(replies[i])["Y"].to_array(), up * (i + 1) * 10)
    np.testing.assert_array_equal(response_tensors(replies[3])["Y"].to_array(), down * -1)
    assert (await stage_stats(served.stage, "light")).inference_count == light_before + 1


async def test_requests_that_go_on_are_batched_together(served):
    before = await stage_stats(served.stage, "heavy")
    xs = [np.full((1, 4), v, np.float32) for v in (1, -1, 2, -2, 3, -3)]
    async with inference_stub(served.router) as stub:
        replies = await asyncio.gather(*(stub.ModelInfer(request_for("cond", X=x), timeout=20) for x in xs))
    for x, reply in zip(xs, replies, strict=True):
        expected = x * 10 if x.sum() > 0 else -x
        np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), expected)
    after = await stage_stats(served.stage, "heavy")
    # The three positive requests, and only they, reached `heavy`: in one execution of three.
    assert after.inference_count - before.inference_count == 3
    assert after.execution_count - before.execution_count == 1
    batches = {b.batch_size: b.compute_infer.count for b in after.batch_stats}
    batches_before = {b.batch_size: b.compute_infer.count for b in before.batch_stats}
    assert batches.get(3, 0) - batches_before.get(3, 0) == 1


async def test_switch_cases_and_default(served):
    x = np.arange(4, dtype=np.float32).reshape(1, 4) + 1
    async with inference_stub(served.router) as stub:
        en = response_tensors(await stub.ModelInfer(request_for("routed", LANG=lang("en"), X=x), timeout=10))
        fr = response_tensors(await stub.ModelInfer(request_for("routed", LANG=lang("fr"), X=x), timeout=10))
        de = response_tensors(await stub.ModelInfer(request_for("routed", LANG=lang("de"), X=x), timeout=10))
    np.testing.assert_array_equal(en["Y"].to_array(), x * 2)
    np.testing.assert_array_equal(fr["Y"].to_array(), x * 21)  # times3, then times7
    np.testing.assert_array_equal(de["Y"].to_array(), x * 5)  # the default branch
    # Z exists on the fr path only, and is declared optional: the others answer without it.
    np.testing.assert_array_equal(fr["Z"].to_array(), x * 33)
    assert "Z" not in en and "Z" not in de


async def test_skipped_producer_skips_its_consumers(served):
    before = {m: (await stage_stats(served.stage, m)).inference_count for m in ("times7", "times11")}
    x = np.ones((1, 4), np.float32)
    async with inference_stub(served.router) as stub:
        await stub.ModelInfer(request_for("routed", LANG=lang("en"), X=x), timeout=10)
    for model in ("times7", "times11"):
        assert (await stage_stats(served.stage, model)).inference_count == before[model]


async def test_a_condition_tensor_of_several_elements_is_refused(served):
    x = np.ones((2, 4), np.float32)
    two = np.array([[b"en"], [b"fr"]], dtype=object)
    async with inference_stub(served.router) as stub:
        err = await rpc_error(stub.ModelInfer(request_for("routed", LANG=two, X=x), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "condition tensor 'LANG' holds 2 elements" in err.details()
        assert "routed" in err.details()
        # The router goes on serving.
        reply = await stub.ModelInfer(request_for("routed", LANG=lang("en"), X=x[:1]), timeout=10)
    np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), x[:1] * 2)


async def test_branch_counts(served):
    step = "0:times2"
    taken, skipped = served.branch_count("routed", step, "true"), served.branch_count("routed", step, "false")
    x = np.ones((1, 4), np.float32)
    async with inference_stub(served.router) as stub:
        for text in ("en", "en", "fr"):
            await stub.ModelInfer(request_for("routed", LANG=lang(text), X=x), timeout=10)
    assert served.branch_count("routed", step, "true") - taken == 2
    assert served.branch_count("routed", step, "false") - skipped == 1
    # On the fr path, the consumers of `fr` ran; on the en paths they were skipped.
    assert served.branch_count("routed", "3:times7", "true") >= 1
    assert served.branch_count("routed", "4:times11", "false") >= 2


async def test_the_trace_shows_skipped_steps(served):
    served.exporter.clear()
    x = np.ones((1, 4), np.float32)
    async with inference_stub(served.router) as stub:
        await stub.ModelInfer(request_for("routed", "traced-1", LANG=lang("en"), X=x), timeout=10)
    spans = served.exporter.get_finished_spans()
    # The request's id is on its span; its steps are in its trace.
    [trace_id] = {s.context.trace_id for s in spans if s.attributes.get("pipeline.request_id") == "traced-1"}
    steps = {
        span.attributes["pipeline.model"]: span
        for span in spans
        if span.name.startswith("step ") and span.context.trace_id == trace_id
    }
    assert set(steps) == {"times2", "times3", "times5", "times7", "times11"}
    assert not steps["times2"].attributes.get("pipeline.step.skipped", False)
    for model in ("times3", "times5"):
        assert steps[model].attributes["pipeline.step.skipped"] is True
        assert "condition not met" in steps[model].attributes["pipeline.step.skip_reason"]
    for model in ("times7", "times11"):
        assert steps[model].attributes["pipeline.step.skipped"] is True
        assert "'fr'" in steps[model].attributes["pipeline.step.skip_reason"]

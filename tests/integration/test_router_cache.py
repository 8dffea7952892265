"""The router's response cache through real servers: hits, misses, the bound, versions, refusals, and
identical requests in flight together."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.ensemble.catalog import load_catalog, load_ensembles
from pipeline.protocol.codec import Tensor, infer_response, metadata_response, response_tensors
from pipeline.protocol.errors import ConfigError, ModelNotFound
from pipeline.protocol.types import TensorSpec
from pipeline.router.router_plane import RouterPlane
from pipeline.runtime.data_plane import DataPlane
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.server import create_server, set_serving
from pipeline.runtime.servicer import InferenceServicer
from pipeline.runtime.telemetry import Telemetry
from pipeline.stage.api import Stage
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving

VEC = (-1, 4)


class Double(Stage):
    """Y = 2X; asks the router to cache its responses, as a `Stage` may."""

    name = "double"
    max_batch_size = 16
    response_cache = True
    inputs = (TensorSpec("X", "FP32", VEC),)
    outputs = (TensorSpec("Y", "FP32", VEC), TensorSpec("NEG", "FP32", VEC))

    def infer(self, inputs):
        return {"Y": inputs["X"] * 2, "NEG": -inputs["X"]}


class Held(Stage):
    """Y = X + 1, held inside `infer` until released: identical requests arrive while it computes."""

    name = "held"
    max_batch_size = 16
    response_cache = True
    inputs = (TensorSpec("X", "FP32", VEC),)
    outputs = (TensorSpec("Y", "FP32", VEC),)

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def infer(self, inputs):
        self.entered.set()
        assert self.release.wait(20)
        return {"Y": inputs["X"] + 1}


class Dice(Stage):
    """Says its answers may differ from call to call."""

    name = "dice"
    max_batch_size = 16
    deterministic = False
    inputs = (TensorSpec("X", "FP32", VEC),)
    outputs = (TensorSpec("Y", "FP32", VEC),)

    def infer(self, inputs):
        return {"Y": inputs["X"] + np.random.default_rng().random(inputs["X"].shape, dtype=np.float32)}


CACHED = """
name: cached
response_cache: {{enable: true}}
stages:
  s: {{address: "{address}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 4]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 4]}}]
steps:
  - {{model_name: double, stage: s, input_map: {{X: X}}, output_map: {{Y: doubled}}}}
  - {{model_name: held, stage: s, input_map: {{X: doubled}}, output_map: {{Y: Y}}}}
"""

#: Small enough that a few dozen responses overflow it.
CACHE_SIZE = 4096


class Served:
    def __init__(
        self, router: str, stage: str, held: Held, metrics: Metrics, exporter: InMemorySpanExporter
    ) -> None:
        self.router, self.stage, self.held, self.metrics = router, stage, held, metrics
        self.exporter = exporter

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cache")
    held = Held()
    held.release.set()
    metrics = Metrics()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with serving_stages([Double(), held]) as stage:
        (folder / "cached.yaml").write_text(CACHED.format(address=stage.address))
        async with serving_router(
            load_ensembles(folder),
            metrics=metrics,
            telemetry=Telemetry(provider),
            options={"cache_size": CACHE_SIZE},
        ) as router:
            await wait_serving(router.address)
            yield Served(router.address, stage.address, held, metrics, exporter)


async def statistics(address: str, model: str) -> pb.ModelStatistics:
    async with inference_stub(address) as stub:
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))
    return reply.model_stats[0]


async def test_a_repeated_request_is_a_hit_and_runs_nothing(served):
    x = np.full((1, 4), 1.5, np.float32)
    router_before = await statistics(served.router, "cached")
    stage_before = await statistics(served.stage, "double")
    async with inference_stub(served.router) as stub:
        first = await stub.ModelInfer(request_for("cached", "first", X=x), timeout=10)
        second = await stub.ModelInfer(request_for("cached", "second", X=x), timeout=10)
    np.testing.assert_array_equal(response_tensors(first)["Y"].to_array(), x * 2 + 1)
    assert response_tensors(second)["Y"].to_array().tobytes() == response_tensors(first)["Y"].raw
    assert (first.id, second.id) == ("first", "second")  # each answer carries its own request's id
    stage_after = await statistics(served.stage, "double")
    assert stage_after.inference_count == stage_before.inference_count + 1
    router_after = await statistics(served.router, "cached")
    hits = router_after.inference_stats.cache_hit.count - router_before.inference_stats.cache_hit.count
    misses = router_after.inference_stats.cache_miss.count - router_before.inference_stats.cache_miss.count
    assert (hits, misses) == (1, 1)
    # A hit is a success and an inference, not an execution (as Triton counts it).
    assert router_after.inference_count - router_before.inference_count == 2
    assert router_after.execution_count - router_before.execution_count == 1
    assert served.sample("pipeline_cache_requests_total", {"model": "cached", "result": "hit"}) >= 1


async def test_the_trace_of_a_hit_says_so(served):
    served.exporter.clear()
    x = np.full((1, 4), 4.5, np.float32)
    async with inference_stub(served.router) as stub:
        await stub.ModelInfer(request_for("cached", "traced-miss", X=x), timeout=10)
        await stub.ModelInfer(request_for("cached", "traced-hit", X=x), timeout=10)
    spans = {
        span.attributes["pipeline.request_id"]: span
        for span in served.exporter.get_finished_spans()
        if span.name == "ModelInfer cached"
    }
    assert spans["traced-miss"].attributes["pipeline.cache.hit"] is False
    assert spans["traced-hit"].attributes["pipeline.cache.hit"] is True
    # The hit ran no step: no step span belongs to its trace.
    hit_trace = spans["traced-hit"].context.trace_id
    assert not [
        s
        for s in served.exporter.get_finished_spans()
        if s.context.trace_id == hit_trace and s.name.startswith("step ")
    ]


async def test_what_changes_the_answer_changes_the_key(served):
    x = np.full((1, 4), 2.5, np.float32)
    before = await statistics(served.router, "cached")
    priority = pb.ModelInferRequest(model_name="cached")
    async with inference_stub(served.router) as stub:
        await stub.ModelInfer(request_for("cached", X=x), timeout=10)  # miss
        await stub.ModelInfer(request_for("cached", X=x.reshape(1, 4) + 0), timeout=10)  # hit: same bytes
        await stub.ModelInfer(request_for("cached", X=x + 1), timeout=10)  # miss: other bytes
        other = request_for("cached", X=x)
        other.parameters["flavour"].string_param = "tart"
        await stub.ModelInfer(other, timeout=10)  # miss: a parameter that may change the answer
        priority.CopyFrom(request_for("cached", X=x))
        priority.parameters["priority"].int64_param = 1
        await stub.ModelInfer(priority, timeout=10)  # hit: scheduling only
    after = await statistics(served.router, "cached")
    hits = after.inference_stats.cache_hit.count - before.inference_stats.cache_hit.count
    misses = after.inference_stats.cache_miss.count - before.inference_stats.cache_miss.count
    assert (hits, misses) == (2, 3)


async def test_a_stage_model_that_asks_for_it_is_cached_too(served):
    x = np.full((1, 4), 3.0, np.float32)
    before = await statistics(served.stage, "double")
    async with inference_stub(served.stage) as direct:  # a call that the router does not see
        await direct.ModelInfer(request_for("double", X=x + 0.25), timeout=10)
    async with inference_stub(served.router) as stub:
        for _ in range(3):
            reply = await stub.ModelInfer(request_for("double", X=x), timeout=10)
        only_neg = request_for("double", X=x)
        only_neg.outputs.add(name="NEG")
        neg = await stub.ModelInfer(only_neg, timeout=10)  # other outputs asked: another entry
    np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), x * 2)
    assert [out.name for out in neg.outputs] == ["NEG"]
    after = await statistics(served.stage, "double")
    assert after.inference_count - before.inference_count == 3
    router = await statistics(served.router, "double")
    assert router.inference_stats.cache_hit.count >= 2
    # The model's figures at the router are its stage's own (the calls the router did not make too), and the
    # requests the router's cache answered (a row each) on top.
    hits = router.inference_stats.cache_hit.count
    assert router.inference_count == after.inference_count + hits
    assert router.execution_count == after.execution_count
    assert router.inference_stats.success.count == after.inference_stats.success.count + hits


async def test_memory_stays_within_the_bound_under_unique_inputs(served):
    evicted = served.sample("pipeline_cache_evictions_total")
    async with inference_stub(served.router) as stub:
        for i in range(60):
            x = np.full((1, 4), 1000 + i, np.float32)
            await stub.ModelInfer(request_for("cached", X=x), timeout=10)
    held_bytes = served.sample("pipeline_cache_bytes", {"cache": "responses"})
    entries = served.sample("pipeline_cache_entries", {"cache": "responses"})
    assert 0 < held_bytes <= CACHE_SIZE
    assert 0 < entries < 60
    assert served.sample("pipeline_cache_evictions_total") - evicted >= 60 - entries
    # The oldest went first: the first of the stream is a miss again, the last still a hit.
    before = await statistics(served.router, "cached")
    async with inference_stub(served.router) as stub:
        await stub.ModelInfer(request_for("cached", X=np.full((1, 4), 1059, np.float32)), timeout=10)
        await stub.ModelInfer(request_for("cached", X=np.full((1, 4), 1000, np.float32)), timeout=10)
    after = await statistics(served.router, "cached")
    assert after.inference_stats.cache_hit.count - before.inference_stats.cache_hit.count == 1
    assert after.inference_stats.cache_miss.count - before.inference_stats.cache_miss.count == 1


async def test_identical_requests_in_flight_are_computed_once(served):
    served.held.release.clear()
    served.held.entered.clear()
    x = np.full((1, 4), 7.0, np.float32)
    before = await statistics(served.stage, "held")
    try:
        async with inference_stub(served.router) as stub:
            calls = [
                asyncio.ensure_future(stub.ModelInfer(request_for("cached", f"r{i}", X=x), timeout=20))
                for i in range(3)
            ]
            assert await asyncio.to_thread(served.held.entered.wait, 10)
            # The two others wait in the router for the first one's response (a statistic says so).
            for _ in range(1000):
                if served.sample("pipeline_cache_waiting", {"cache": "responses"}) == 2:
                    break
                await asyncio.sleep(0.01)
            assert served.sample("pipeline_cache_waiting", {"cache": "responses"}) == 2
            served.held.release.set()
            replies = await asyncio.gather(*calls)
    finally:
        served.held.release.set()
    assert [reply.id for reply in replies] == ["r0", "r1", "r2"]
    for reply in replies:
        np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), x * 2 + 1)
    after = await statistics(served.stage, "held")
    assert after.inference_count - before.inference_count == 1


# --- versions and refusals, each with servers of its own -------------------------------------------------

VERSIONED_MODEL = """
import numpy as np
from pipeline.stage import Stage, TensorSpec


class Versioned(Stage):
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, 4)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 4)),)

    def infer(self, inputs):
        return {{"Y": inputs["X"] * {factor}}}
"""

CACHED_CONFIG = 'backend: "python"\nresponse_cache { enable: true }\n'


async def test_entries_of_a_version_no_longer_served_are_dropped(tmp_path: Path):
    folder = tmp_path / "versioned"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(VERSIONED_MODEL.format(factor=1))
    (folder / "config.pbtxt").write_text(CACHED_CONFIG)
    metrics = Metrics()
    x = np.ones((1, 4), np.float32)
    async with serving_stages(
        [],
        repository=ModelRepository(tmp_path),
        backends=[PythonBackend()],
        options={"model_control_mode": "explicit"},
    ) as stage:
        await wait_serving(stage.address)
        catalog = load_catalog(stages={"s": stage.address})
        async with serving_router(catalog, metrics=metrics, options={"cache_size": 1 << 20}) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                first = await stub.ModelInfer(request_for("versioned", X=x), timeout=10)
                assert first.model_version == "1"
                np.testing.assert_array_equal(response_tensors(first)["Y"].to_array(), x)
                entries = metrics.registry.get_sample_value("pipeline_cache_entries", {"cache": "responses"})
                assert entries == 1
                # Version 2 arrives; the stage serves it instead of version 1 (Triton's latest policy).
                (folder / "2").mkdir()
                (folder / "2" / "model.py").write_text(VERSIONED_MODEL.format(factor=2))
                async with inference_stub(stage.address) as stage_stub:
                    await stage_stub.RepositoryModelLoad(
                        pb.RepositoryModelLoadRequest(model_name="versioned")
                    )
                # The router sees version 1 gone from the stage's RepositoryIndex and drops its entries.
                for _ in range(1000):
                    if not metrics.registry.get_sample_value(
                        "pipeline_cache_entries", {"cache": "responses"}
                    ):
                        break
                    await asyncio.sleep(0.01)
                assert (
                    metrics.registry.get_sample_value("pipeline_cache_entries", {"cache": "responses"}) == 0
                )
                second = await stub.ModelInfer(request_for("versioned", X=x), timeout=10)
    assert second.model_version == "2"
    np.testing.assert_array_equal(response_tensors(second)["Y"].to_array(), x * 2)


async def test_caching_a_non_deterministic_model_is_refused_at_load(tmp_path: Path):
    # In its config.pbtxt: the stage refuses to load it, and says why.
    folder = tmp_path / "sampler"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(VERSIONED_MODEL.format(factor=1))
    (folder / "config.pbtxt").write_text(
        CACHED_CONFIG + 'parameters { key: "deterministic" value { string_value: "false" } }\n'
    )
    # As a Stage attribute, with the cache asked for in the config.
    other = tmp_path / "roller"
    (other / "1").mkdir(parents=True)
    (other / "1" / "model.py").write_text(
        VERSIONED_MODEL.format(factor=1).replace(
            "max_batch_size = 8", "max_batch_size = 8\n    deterministic = False"
        )
    )
    (other / "config.pbtxt").write_text(CACHED_CONFIG)
    async with serving_stages(
        [],
        repository=ModelRepository(tmp_path),
        backends=[PythonBackend()],
        options={"model_control_mode": "explicit"},
    ) as stage:
        await wait_serving(stage.address)
        async with inference_stub(stage.address) as stub:
            for model in ("sampler", "roller"):
                err = await rpc_error(
                    stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=model))
                )
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (
                    "response_cache is enabled, but the model declares itself non-deterministic"
                    in err.details()
                )
                assert model in err.details()


async def test_an_ensemble_cache_over_a_non_deterministic_step_is_refused(tmp_path: Path):
    async with serving_stages([Dice()]) as stage:
        (tmp_path / "rolled.yaml").write_text(
            CACHED.format(address=stage.address)
            .replace("name: cached", "name: rolled")
            .replace("model_name: double", "model_name: dice")
            .replace("  - {model_name: held, stage: s, input_map: {X: doubled}, output_map: {Y: Y}}\n", "")
            .replace("output_map: {Y: doubled}", "output_map: {Y: Y}")
        )
        plane = RouterPlane(load_ensembles(tmp_path), cache_size=1 << 20)
        try:
            with pytest.raises(ConfigError) as info:
                await plane.discover(retry_interval=0.05)
        finally:
            await plane.close()
    message = str(info.value)
    assert "rolled.yaml: response_cache is enabled, but step 0 (dice) calls model 'dice'" in message
    assert "non-deterministic" in message


class Flipping(DataPlane):
    """A plain OIP stage (no RepositoryIndex) whose model answers as version `version`, X + version; it can
    stop serving the model (NOT_FOUND)."""

    SPEC = (TensorSpec("X", "FP32", VEC),)

    def __init__(self) -> None:
        self.version = "1"
        self.calls = 0
        self.gone = False

    def ready(self) -> bool:
        return True

    async def model_ready(self, name, version):
        return name == "flip" and not self.gone

    async def model_metadata(self, name, version, call):
        return metadata_response("flip", (self.version,), "python", self.SPEC, self.SPEC)

    async def model_config(self, name, version, call):
        config = mc.ModelConfig(name="flip", max_batch_size=16)
        config.response_cache.enable = True
        return config

    async def infer(self, request, call):
        if self.gone:
            raise ModelNotFound("unknown model 'flip'")
        self.calls += 1
        x = Tensor("X", "FP32", tuple(request.inputs[0].shape), request.raw_input_contents[0]).to_array()
        return infer_response(
            "flip", self.version, request.id, [Tensor.from_array("X", x + float(self.version))]
        )


FLIP = """
name: flipped
stages:
  f: {{address: "{address}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 4]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 4]}}]
steps:
  - {{model_name: flip, stage: f, input_map: {{X: X}}, output_map: {{X: Y}}}}
"""


async def test_a_version_change_or_not_found_drops_entries_of_a_plain_stage(tmp_path: Path):
    stage = Flipping()
    stage_health = health.aio.HealthServicer()
    server, port = await create_server(
        "127.0.0.1:0", InferenceServicer(InferenceHandler(stage, "flip")), stage_health
    )
    await server.start()
    await set_serving(stage_health, True)
    (tmp_path / "flipped.yaml").write_text(FLIP.format(address=f"127.0.0.1:{port}"))
    a, b = np.zeros((1, 4), np.float32), np.ones((1, 4), np.float32)
    try:
        async with (
            serving_router(load_ensembles(tmp_path), options={"cache_size": 1 << 20}) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            first = await stub.ModelInfer(request_for("flip", X=a), timeout=10)
            await stub.ModelInfer(request_for("flip", X=a), timeout=10)
            assert (first.model_version, stage.calls) == ("1", 1)  # the second was a hit
            # The stage now answers as version 2: the first miss that sees it drops version 1's entries.
            stage.version = "2"
            await stub.ModelInfer(request_for("flip", X=b), timeout=10)
            again = await stub.ModelInfer(request_for("flip", X=a), timeout=10)
            assert (again.model_version, stage.calls) == ("2", 3)
            np.testing.assert_array_equal(response_tensors(again)["X"].to_array(), a + 2)
            # NOT_FOUND from the stage drops the model's entries: the next request asks the stage again.
            stage.gone = True
            err = await rpc_error(stub.ModelInfer(request_for("flip", X=b + 1), timeout=10))
            assert err.code() == grpc.StatusCode.NOT_FOUND
            stage.gone = False
            await stub.ModelInfer(request_for("flip", X=a), timeout=10)
            assert stage.calls == 4
    finally:
        await server.stop(None)

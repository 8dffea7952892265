"""The router over a model repository: Triton's config.pbtxt ensembles, stages found through their
RepositoryIndex, every stage model served, each model's own dynamic_batching, and ensembles whose models no
stage serves reported UNAVAILABLE with the reason while the rest serves."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
from collections.abc import Mapping
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1.health_pb2 import HealthCheckResponse

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_catalog
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.errors import ConfigError
from pipeline.router.main import add_router_arguments, router_catalog, serve_router
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.router_settings import RouterSettings
from pipeline.runtime.server import INFERENCE_SERVICE
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import router_settings_of, serving_router, serving_stages
from tests.conftest import (
    health_status,
    inference_stub,
    request_for,
    rpc_error,
    wait_serving,
    watch_health,
)
from tests.stages import HOLD, Scale, write_model

ROWS = (-1, 3)
SERVING = HealthCheckResponse.SERVING
NOT_SERVING = HealthCheckResponse.NOT_SERVING


#: A stage model.py: Y = X * SCALE + OFFSET on rows of 3.
AFFINE = """
from pipeline.stage import Stage, TensorSpec

class Affine(Stage):
    max_batch_size = 16
    inputs = (TensorSpec("X", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def infer(self, inputs):
        return {{"Y": inputs["X"] * {scale} + {offset}}}
"""

#: A stage model.py that holds each call until the test releases it, so that the router's queue fills.
GATED = """
from pipeline.stage import Stage, TensorSpec
from tests.stages import HOLD

class Gate(Stage):
    max_batch_size = 4
    inputs = (TensorSpec("X", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def infer(self, inputs):
        HOLD["entered"].set()
        assert HOLD["release"].wait(20)
        return {"Y": inputs["X"]}
"""

#: A stage model.py whose load waits until the test says the model has loaded.
SLOW = """
from pipeline.stage import Stage, TensorSpec
from tests.stages import HOLD

class Slow(Stage):
    max_batch_size = 16
    inputs = (TensorSpec("X", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def load(self):
        assert HOLD["loaded"].wait(30)

    def infer(self, inputs):
        return {"Y": inputs["X"] + 1}
"""


def scale_model(factor: float = 2.0) -> str:
    return AFFINE.format(scale=factor, offset=0)


def offset_model() -> str:
    return AFFINE.format(scale=1, offset=1)


def stage_repository(
    root: Path, models: Mapping[str, str], batching: Mapping[str, str] | None = None
) -> Path:
    """A repository of python stages: `models` maps a name to its model.py; `batching` to the text of its
    config's `dynamic_batching` block."""
    for name, source in models.items():
        own = (batching or {}).get(name)
        config = f'backend: "python"\ndynamic_batching {{ {own} }}\n' if own is not None else None
        write_model(root, name, source, config)
    return root


def serving_repository(root: Path):
    """A real stage service serving the python stages of `root`."""
    return serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()])


CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 16
input [ { name: "X", data_type: TYPE_FP32, dims: [ 3 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 3 ] } ]
ensemble_scheduling {
  step [
    { model_name: "scale" model_version: -1
      input_map { key: "X" value: "X" } output_map { key: "Y" value: "doubled" } },
    { model_name: "offset" model_version: -1
      input_map { key: "X" value: "doubled" } output_map { key: "Y" value: "OUT" } }
  ]
}
"""

# Both stages serve 'twice'; the first declared ('a') must get its calls.
TWICE = """
name: "twice_ensemble"
platform: "ensemble"
max_batch_size: 16
input [ { name: "X", data_type: TYPE_FP32, dims: [ 3 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 3 ] } ]
ensemble_scheduling { step [
  { model_name: "twice" input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y" } },
  { model_name: "gate" input_map { key: "X" value: "X" } output_map { key: "Y" value: "unused" } }
] }
"""

# A YAML ensemble beside them: it names its stages, one of which ('plain') has no RepositoryIndex.
YAML = """
name: yamlchain
stages:
  a: {{address: "{a}"}}
  plain: {{address: "{plain}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: plain_scale, stage: plain, input_map: {{X: X}}, output_map: {{Y: mid}}}}
  - {{model_name: own_off, stage: a, input_map: {{X: mid}}, output_map: {{Y: Y}}, dynamic_batching: false}}
"""


def write_config(root: Path, name: str, text: str) -> Path:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(text)
    return folder / "config.pbtxt"


#: The gate model's own dynamic_batching: a queue of two, two priority levels.
GATE_BATCHING = "priority_levels: 2 default_priority_level: 2 default_queue_policy { max_queue_size: 2 }"


class Served:
    def __init__(self, router, a, b, plain) -> None:
        self.router, self.a, self.b, self.plain = router, a, b, plain


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("repository")
    write_config(root, "chain", CHAIN)
    write_config(root, "twice_ensemble", TWICE)
    own = {"gate": GATE_BATCHING, "lonely": ""}
    repo_a = stage_repository(
        tmp_path_factory.mktemp("a"),
        {"scale": scale_model(), "twice": scale_model(), "gate": GATED, "own_off": offset_model()},
        own,
    )
    repo_b = stage_repository(
        tmp_path_factory.mktemp("b"),
        {"offset": offset_model(), "twice": offset_model(), "lonely": offset_model()},
        own,
    )
    async with (
        serving_repository(repo_a) as a,
        serving_repository(repo_b) as b,
        serving_stages([Scale("plain_scale"), Scale("hidden")]) as plain,
    ):
        folder = tmp_path_factory.mktemp("ensembles")
        (folder / "yamlchain.yaml").write_text(YAML.format(a=a.address, plain=plain.address))
        catalog = load_catalog(
            [folder], repository=root, stages={"a": a.address, "b": b.address, "plain": plain.address}
        )
        async with serving_router(catalog) as router:
            await wait_serving(router.address)
            yield Served(router.address, a, b, plain)


X = np.arange(6, dtype=np.float32).reshape(2, 3)


async def stage_executions(address: str, model: str) -> int:
    async with inference_stub(address) as stub:
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))
    return reply.model_stats[0].execution_count


async def router_batches(address: str, model: str) -> dict[int, int]:
    """Batch size -> executions of a model, from the router's ModelStatistics."""
    async with inference_stub(address) as stub:
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))
    return {b.batch_size: b.compute_infer.count for b in reply.model_stats[0].batch_stats}


async def test_a_config_pbtxt_ensemble_is_served_end_to_end(served):
    async with inference_stub(served.router) as stub:
        reply = await stub.ModelInfer(request_for("chain", X=X), timeout=20)
        np.testing.assert_array_equal(response_tensors(reply)["OUT"].to_array(), 2 * X + 1)
        meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="chain"))
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="chain"))).config
    assert meta.platform == "ensemble"
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("X", "FP32", [-1, 3])]
    assert config.platform == "ensemble" and [list(t.dims) for t in config.output] == [[3]]
    assert [s.model_name for s in config.ensemble_scheduling.step] == ["scale", "offset"]


async def test_a_model_two_stages_serve_goes_to_the_first_declared(served):
    before = await stage_executions(served.a.address, "twice")
    async with inference_stub(served.router) as stub:
        HOLD["release"].set()
        try:
            reply = await stub.ModelInfer(request_for("twice_ensemble", X=X), timeout=20)
        finally:
            HOLD["release"].clear()
    np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 2 * X)  # Scale, not Offset
    assert await stage_executions(served.a.address, "twice") == before + 1
    assert await stage_executions(served.b.address, "twice") == 0


async def test_every_model_of_the_stages_repositories_is_served(served):
    async with inference_stub(served.router) as stub:
        # 'lonely' is in no ensemble: stage b's RepositoryIndex is how the router knows it.
        meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="lonely"))
        assert [t.name for t in meta.inputs] == ["X"]
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="lonely"))).config
        assert config.name == "lonely" and config.max_batch_size == 16
        assert (await stub.ModelReady(pb.ModelReadyRequest(name="lonely"))).ready
        reply = await stub.ModelInfer(request_for("lonely", X=X), timeout=20)
        np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), X + 1)
        stats = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="lonely"))).model_stats[0]
        assert stats.inference_count == 2 and stats.inference_stats.success.count == 1
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
        # A plain OIP stage (no RepositoryIndex) serves only what the ensembles name on it.
        err = await rpc_error(stub.ModelInfer(request_for("hidden", X=X), timeout=20))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "lonely" in err.details()
        assert not (await stub.ModelReady(pb.ModelReadyRequest(name="hidden"))).ready
    listed = {(m.name, m.state) for m in index.models}
    expected = {"chain", "twice_ensemble", "yamlchain", "scale", "twice", "gate", "own_off"}
    expected |= {"offset", "lonely", "plain_scale"}
    assert listed == {(name, "READY") for name in expected}
    assert [m.name for m in index.models].count("twice") == 1


async def test_the_models_own_dynamic_batching_is_used(served):
    x = np.ones((1, 3), np.float32)
    HOLD["entered"].clear()
    before = await router_batches(served.router, "gate")
    async with inference_stub(served.router) as stub:
        # A priority that is not an integer is refused by the router's batcher, as Triton refuses it.
        bad = request_for("gate", X=x)
        bad.parameters["priority"].string_param = "1"
        err = await rpc_error(stub.ModelInfer(bad, timeout=20))
        assert (
            err.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "'priority' must be an integer" in err.details()
        )

        first = asyncio.ensure_future(stub.ModelInfer(request_for("gate", X=x), timeout=30))
        assert await asyncio.to_thread(HOLD["entered"].wait, 10)
        queued = [
            asyncio.ensure_future(stub.ModelInfer(request_for("gate", X=x), timeout=30)) for _ in range(2)
        ]
        refused = None
        for _ in range(100):  # its own queue policy (max_queue_size 2) is full once both have arrived
            try:
                await stub.ModelInfer(request_for("gate", X=x), timeout=30)
            except grpc.aio.AioRpcError as error:
                refused = error
                break
            await asyncio.sleep(0.05)
        HOLD["release"].set()
        try:
            await asyncio.gather(first, *queued)
            # Its own priority_levels (2): a third level is its default level, as Triton takes it.
            beyond = request_for("gate", X=x)
            beyond.parameters["priority"].int64_param = 3
            await stub.ModelInfer(beyond, timeout=30)
        finally:
            HOLD["release"].clear()
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "(model 'gate') is saturated" in refused.details()
    # The first went alone; the two queued behind it went to the stage as one batch; the last alone.
    after = await router_batches(served.router, "gate")
    assert {size: after[size] - before.get(size, 0) for size in after} == {1: 2, 2: 1}


async def test_dynamic_batching_false_on_a_step_calls_a_model_without_its_own_unbatched(served):
    request = request_for("yamlchain", X=X)
    request.parameters["priority"].int64_param = 7  # no batcher, so no priority levels
    async with inference_stub(served.router) as stub:
        reply = await stub.ModelInfer(request, timeout=20)
        stats = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="own_off"))).model_stats[0]
    async with inference_stub(served.a.address) as stub:
        own = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="own_off"))).model_stats[0]
    np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 2 * X + 1)
    # Not batched at the router: its statistics there are the stage's own, one execution of the request.
    assert stats == own
    assert [(b.batch_size, b.compute_infer.count) for b in stats.batch_stats] == [(2, 1)]


async def test_the_router_waits_for_a_stage_that_is_still_loading_the_model(tmp_path, caplog):
    write_config(tmp_path, "late", CHAIN.replace('"chain"', '"late"').replace('"offset"', '"slow"'))
    repository = stage_repository(tmp_path / "stage", {"scale": scale_model(), "slow": SLOW})
    HOLD["loaded"].clear()
    try:
        async with serving_repository(repository) as stage:
            catalog = load_catalog(repository=tmp_path, stages={"only": stage.address})
            with caplog.at_level(logging.INFO, logger="pipeline.router"):
                async with serving_router(catalog) as router, inference_stub(router.address) as stub:
                    # Answered once the router has first looked at its stage: with the reason, not held.
                    err = await rpc_error(stub.ModelInfer(request_for("late", X=X), timeout=20))
                    assert err.code() == grpc.StatusCode.UNAVAILABLE
                    assert "stage 'only' still loading" in err.details() and "slow" in err.details()
                    waiting = re.compile(r"waiting for a stage that serves model\(s\) (\w+, )*slow\b")
                    assert waiting.search(caplog.text), caplog.text
                    assert stage.address in caplog.text
                    assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready

                    HOLD["loaded"].set()  # the stage has loaded it
                    await watch_health(router.address, INFERENCE_SERVICE, SERVING)
                    assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
                    reply = await stub.ModelInfer(request_for("late", X=X), timeout=20)
                    np.testing.assert_array_equal(response_tensors(reply)["OUT"].to_array(), 2 * X + 1)
            assert "model 'slow' is served by stage 'only'" in caplog.text
    finally:
        HOLD["loaded"].set()


async def test_a_mismatch_with_the_stage_names_the_config_pbtxt(tmp_path):
    config = write_config(
        tmp_path,
        "chain",
        CHAIN.replace("TYPE_FP32, dims: [ 3 ] } ]\noutput", "TYPE_INT32, dims: [ 3 ] } ]\noutput"),
    )
    repository = stage_repository(tmp_path / "stage", {"scale": scale_model(), "offset": offset_model()})
    async with serving_repository(repository) as stage:
        args = router_settings_of(max_message_mb=4, grace_period=1)
        catalog = load_catalog(repository=tmp_path, stages={"only": stage.address})
        with pytest.raises(ConfigError) as info:
            await asyncio.wait_for(serve_router(args, catalog=catalog, stopping=asyncio.Event()), 20)
    message = str(info.value)
    assert str(config) in message and "step 0 (scale)" in message and "'X'" in message and "INT32" in message


async def test_no_stage_with_a_repository_index_is_a_clear_error(tmp_path):
    write_config(tmp_path, "chain", CHAIN)
    async with serving_stages([Scale(), Scale("offset")]) as plain:
        args = router_settings_of(max_message_mb=4, grace_period=1)
        catalog = load_catalog(repository=tmp_path, stages={"plain": plain.address})
        with pytest.raises(ConfigError) as info:
            await asyncio.wait_for(serve_router(args, catalog=catalog, stopping=asyncio.Event()), 20)
    assert "none of plain implements RepositoryIndex" in str(info.value)
    assert "offset, scale" in str(info.value)


def test_router_flags_read_the_repository_and_the_stages(tmp_path, monkeypatch):
    write_config(tmp_path, "chain", CHAIN)
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    monkeypatch.setenv("MODEL_ADDRESS", "10.0.0.2:7000")
    monkeypatch.delenv("PREPROCESS_ADDRESS", raising=False)
    monkeypatch.setenv("POSTPROCESS_ADDRESS", "")
    monkeypatch.chdir(tmp_path)  # no ensembles/ folder here: a router with a repository needs none
    catalog = router_catalog(RouterSettings.parse(parser, ["--model-repository", str(tmp_path)]))
    assert list(catalog.ensembles) == ["chain"]
    assert {key: e.address for key, e in catalog.stages.items()} == {
        "preprocess": "127.0.0.1:8101",
        "model": "10.0.0.2:7000",
        "postprocess": "127.0.0.1:8103",
    }
    args = RouterSettings.parse(
        parser, ["--model-dir", str(tmp_path), "--stage", "x=127.0.0.1:9", "--stage", "y=[::1]:8"]
    )
    assert {key: e.address for key, e in router_catalog(args).stages.items()} == {
        "x": "127.0.0.1:9",
        "y": "[::1]:8",
    }
    with pytest.raises(SystemExit):
        parser.parse_args(["--stage", "no-address"])
    with pytest.raises(ConfigError, match="no such folder"):
        router_catalog(RouterSettings.parse(parser, ["--model-dir", str(tmp_path / "missing")]))
    write_config(
        tmp_path,
        "broken",
        CHAIN.replace('"chain"', '"broken"').replace('value: "doubled" } }', 'value: "doubeld" } }', 1),
    )
    with pytest.raises(ConfigError) as info:
        router_catalog(RouterSettings.parse(parser, ["--model-dir", str(tmp_path)]))
    message = str(info.value)
    assert str(tmp_path / "broken" / "config.pbtxt") in message
    assert "step 1 (offset): input 'X' ← tensor 'doubled': nothing produces 'doubled'" in message


# --- ensembles whose models are not served ------------------------------------------------------------

#: A config.pbtxt ensemble whose second step's model no stage serves (until the test loads it).
LOST = CHAIN.replace('"chain"', '"lost"').replace('"offset"', '"missing"')
#: A YAML ensemble naming its stage, whose model that stage does not serve.
ABSENT = """
name: absent
stages: {{only: {{address: "{address}"}}}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: nowhere, stage: only, input_map: {{X: X}}, output_map: {{Y: Y}}}}
"""


async def ensemble_states(stub) -> dict[str, tuple[str, str]]:
    index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
    return {m.name: (m.state, m.reason) for m in index.models if m.name in ("chain", "lost", "absent")}


async def load(address: str, model: str) -> None:
    async with inference_stub(address) as stub:
        await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=model), timeout=20)


async def test_an_ensemble_whose_models_no_stage_serves_is_unavailable_and_the_rest_serves(tmp_path, caplog):
    write_config(tmp_path, "chain", CHAIN)
    write_config(tmp_path, "lost", LOST)
    stage_root = stage_repository(tmp_path / "stage", {"scale": scale_model(), "offset": offset_model()})
    async with serving_stages(
        [],
        repository=ModelRepository(stage_root),
        backends=[PythonBackend()],
        options={"model_control_mode": "explicit"},
    ) as stage:
        await wait_serving(stage.address)
        (tmp_path / "ensembles").mkdir()
        (tmp_path / "ensembles" / "absent.yaml").write_text(ABSENT.format(address=stage.address))
        catalog = load_catalog([tmp_path / "ensembles"], repository=tmp_path, stages={"only": stage.address})

        # Not strict: ready once started, each ensemble's readiness its own.
        options = {"strict_readiness": False}
        async with serving_router(catalog, options=options) as router, inference_stub(router.address) as stub:
            await watch_health(router.address, "", SERVING)
            assert await health_status(router.address, INFERENCE_SERVICE) == SERVING
            assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="chain"))).ready
            assert not (await stub.ModelReady(pb.ModelReadyRequest(name="absent"))).ready

        with caplog.at_level(logging.INFO, logger="pipeline.router"):
            async with serving_router(catalog) as router, inference_stub(router.address) as stub:
                await watch_health(router.address, "", SERVING)  # live, and serving what it can
                reply = await stub.ModelInfer(request_for("chain", X=X), timeout=20)
                np.testing.assert_array_equal(response_tensors(reply)["OUT"].to_array(), 2 * X + 1)

                states = await ensemble_states(stub)
                assert states["chain"] == ("READY", "")
                assert states["lost"][0] == "UNAVAILABLE"
                assert "no stage serves model(s) missing" in states["lost"][1]
                assert stage.address in states["lost"][1]  # where the router looked
                assert states["absent"][0] == "UNAVAILABLE" and "model 'nowhere'" in states["absent"][1]
                assert (await stub.ModelReady(pb.ModelReadyRequest(name="chain"))).ready
                assert not (await stub.ModelReady(pb.ModelReadyRequest(name="lost"))).ready
                err = await rpc_error(stub.ModelInfer(request_for("lost", X=X), timeout=20))
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert "ensemble 'lost' is not available" in err.details() and "missing" in err.details()
                assert "ensemble 'lost' is not available: no stage serves model(s) missing" in caplog.text
                # Strict readiness (Triton's default): not ready while an ensemble is not available.
                assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
                assert await health_status(router.address, INFERENCE_SERVICE) == NOT_SERVING

                # Its model loaded on the stage: the next request for the ensemble is served, no restart.
                write_model(stage_root, "missing", offset_model())
                await load(stage.address, "missing")
                reply = await stub.ModelInfer(request_for("lost", X=X), timeout=20)
                np.testing.assert_array_equal(response_tensors(reply)["OUT"].to_array(), 2 * X + 1)
                assert "ensemble 'lost' is available" in caplog.text
                assert (await ensemble_states(stub))["lost"] == ("READY", "")
                assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready  # 'absent' is not

                # The last one's model loaded, and nothing asks for it: the router finds it, and is ready.
                write_model(stage_root, "nowhere", AFFINE.format(scale=3, offset=0))
                await load(stage.address, "nowhere")
                await watch_health(router.address, INFERENCE_SERVICE, SERVING)
                assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
                assert (await ensemble_states(stub))["absent"] == ("READY", "")
                reply = await stub.ModelInfer(request_for("absent", X=X), timeout=20)
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 3 * X)

                # A model unloaded from its stage takes its ensemble with it, as Triton's ensemble stops being
                # ready with its models; loaded again, the ensemble serves again.
                async with inference_stub(stage.address) as stage_stub:
                    await stage_stub.RepositoryModelUnload(
                        pb.RepositoryModelUnloadRequest(model_name="missing")
                    )
                assert not (await stub.ModelReady(pb.ModelReadyRequest(name="lost"))).ready
                state, reason = (await ensemble_states(stub))["lost"]
                assert state == "UNAVAILABLE" and "'missing' on stage 'only' no longer served" in reason
                await watch_health(router.address, INFERENCE_SERVICE, NOT_SERVING)
                assert (await stub.ModelReady(pb.ModelReadyRequest(name="chain"))).ready
                await load(stage.address, "missing")
                reply = await stub.ModelInfer(request_for("lost", X=X), timeout=20)
                np.testing.assert_array_equal(response_tensors(reply)["OUT"].to_array(), 2 * X + 1)
                await watch_health(router.address, INFERENCE_SERVICE, SERVING)


def test_the_ensembles_folder_is_optional_and_readiness_is_strict_unless_told(tmp_path, monkeypatch):
    write_config(tmp_path, "chain", CHAIN)
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    (tmp_path / "empty").mkdir()
    for folder in ("empty", "missing"):
        catalog = router_catalog(
            RouterSettings.parse(
                parser, ["--model-dir", str(tmp_path), "--ensembles", str(tmp_path / folder)]
            )
        )
        assert list(catalog.ensembles) == ["chain"]
    assert parser.parse_args([]).strict_readiness is True
    assert parser.parse_args(["--strict-readiness", "false"]).strict_readiness is False
    monkeypatch.setenv("PIPELINE_STRICT_READINESS", "false")
    fresh = argparse.ArgumentParser()
    add_router_arguments(fresh)
    assert fresh.parse_args([]).strict_readiness is False


async def test_discovery_learns_each_model_and_gives_it_its_batcher_before_any_request(tmp_path):
    """A repository model that no ensemble names is learnt by the router's discovery, not by its first
    request: once the router is ready, the batcher its own dynamic_batching asks for runs (its queue-depth
    gauge is exported) before any request for it; a model whose folder is added and loaded through the
    router after start has its batcher when the load returns. Each then serves its requests, batched at the
    router (its statistics are the router's own batches)."""
    explicit = {"model_control_mode": "explicit"}
    root = stage_repository(tmp_path / "stage", {"lonely": offset_model()}, {"lonely": ""})
    stage = serving_stages(
        [], repository=ModelRepository(root), backends=[PythonBackend()], options=explicit, models=["lonely"]
    )
    metrics = Metrics()

    def queue_depth(model: str) -> float | None:
        return metrics.registry.get_sample_value("pipeline_queue_depth", {"model": model})

    async with stage as a:
        catalog = load_catalog(repository=tmp_path / "ensembles", stages={"a": a.address})
        async with (
            serving_router(catalog, metrics=metrics, options=explicit) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            assert queue_depth("lonely") == 0.0
            stage_repository(root, {"later": scale_model()}, {"later": ""})
            await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="later"), timeout=60)
            assert queue_depth("later") == 0.0
            for model, expected in (("lonely", X + 1), ("later", 2 * X)):
                reply = await stub.ModelInfer(request_for(model, X=X), timeout=20)
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), expected)
                assert await router_batches(router.address, model) == {2: 1}

"""The router over real gRPC: DAG execution (fan-out, fan-in, concurrency), forwarding, context, errors."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import Tensor, infer_response, response_tensors
from pipeline.protocol.errors import ConfigError, InvalidInput, ModelNotFound
from pipeline.protocol.types import TensorSpec
from pipeline.router.main import serve_router
from pipeline.runtime.data_plane import DataPlane, RequestContext
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.server import create_server, set_serving
from pipeline.runtime.servicer import InferenceServicer
from pipeline.stage.api import Stage
from pipeline.tools.testing import router_settings_of, serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving

# Both branches of the diamond wait here for each other: a router that ran them one after the other
# would break the barrier (and the request) instead of passing it.
BRANCHES_MEET = threading.Barrier(2, timeout=10)

VEC = (-1, 4)


class Double(Stage):
    name = "double"
    max_batch_size = 16
    inputs = (TensorSpec("X", "FP32", VEC),)
    outputs = (TensorSpec("Y", "FP32", VEC),)

    def infer(self, inputs):
        BRANCHES_MEET.wait()
        return {"Y": inputs["X"] * 2}


class PlusOne(Stage):
    name = "plus_one"
    max_batch_size = 16
    inputs = (TensorSpec("X", "FP32", VEC),)
    outputs = (TensorSpec("Y", "FP32", VEC),)

    def infer(self, inputs):
        BRANCHES_MEET.wait()
        return {"Y": inputs["X"] + 1}


class Add(Stage):
    name = "add"
    max_batch_size = 16
    inputs = (TensorSpec("A", "FP32", VEC), TensorSpec("B", "FP32", VEC))
    outputs = (TensorSpec("SUM", "FP32", VEC),)

    def infer(self, inputs):
        if (inputs["A"] < -1000).any():
            raise InvalidInput(f"A[{int(np.argmax((inputs['A'] < -1000).any(axis=1)))}]: too small")
        return {"SUM": inputs["A"] + inputs["B"]}


class Recorder(DataPlane):
    """A stage that records the deadline and metadata each call arrives with, and can be slow."""

    SPEC = (TensorSpec("X", "FP32", VEC),)

    def __init__(self) -> None:
        self.calls: list[RequestContext] = []
        self.delay = 0.0

    def ready(self) -> bool:
        return True

    async def model_ready(self, name, version):
        return name == "recorder"

    async def model_metadata(self, name, version, call):
        from pipeline.protocol.codec import metadata_response

        if name != "recorder":
            raise ModelNotFound(name)
        return metadata_response("recorder", ("1",), "python", self.SPEC, self.SPEC)

    async def model_config(self, name, version, call):
        return mc.ModelConfig(name="recorder", max_batch_size=16)

    async def infer(self, request, call):
        self.calls.append(call)
        await asyncio.sleep(self.delay)
        x = Tensor("X", "FP32", tuple(request.inputs[0].shape), request.raw_input_contents[0])
        return infer_response("recorder", "1", request.id, [x])


DIAMOND = """
name: diamond
stages:
  math: {{address: "{math}"}}
  spy: {{address: "{spy}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 4]}}]
outputs: [{{name: OUT, datatype: FP32, shape: [-1, 4]}}]
steps:
  - {{model_name: double, stage: math, input_map: {{X: X}}, output_map: {{Y: doubled}}}}
  - {{model_name: plus_one, stage: math, input_map: {{X: X}}, output_map: {{Y: bumped}}}}
  - {{model_name: add, stage: math, input_map: {{A: doubled, B: bumped}}, output_map: {{SUM: OUT}}}}
"""

SPY = """
name: spied
stages:
  spy: {{address: "{spy}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 4]}}]
outputs: [{{name: X2, datatype: FP32, shape: [-1, 4]}}]
steps:
  - {{model_name: recorder, stage: spy, input_map: {{X: X}}, output_map: {{X: X2}}}}
"""


class Served:
    def __init__(self, router: str, recorder: Recorder, math) -> None:
        self.router, self.recorder, self.math = router, recorder, math


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    recorder = Recorder()
    spy_health = health.aio.HealthServicer()
    spy_server, spy_port = await create_server(
        "127.0.0.1:0", InferenceServicer(InferenceHandler(recorder, "spy")), spy_health
    )
    await spy_server.start()
    await set_serving(spy_health, True)
    folder: Path = tmp_path_factory.mktemp("ensembles")
    async with serving_stages([Double(), PlusOne(), Add()]) as math:
        addresses = {"math": math.address, "spy": f"127.0.0.1:{spy_port}"}
        (folder / "diamond.yaml").write_text(DIAMOND.format(**addresses))
        (folder / "spied.yaml").write_text(SPY.format(**addresses))
        async with serving_router(load_ensembles([folder])) as router:
            await wait_serving(router.address)
            yield Served(router.address, recorder, math)
    await spy_server.stop(0)


X = np.arange(8, dtype=np.float32).reshape(2, 4)


async def test_diamond_runs_branches_concurrently_and_joins(served):
    async with inference_stub(served.router) as stub:
        response = await stub.ModelInfer(request_for("diamond", X=X), timeout=30)
    assert response.model_name == "diamond" and response.id == "req-1"
    np.testing.assert_array_equal(response_tensors(response)["OUT"].to_array(), 3 * X + 1)
    assert len(response.raw_output_contents) == 1


async def test_ensemble_metadata_and_config(served):
    async with inference_stub(served.router) as stub:
        meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="diamond"))
        assert meta.platform == "ensemble"
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("X", "FP32", [-1, 4])]
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="diamond"))).config
        assert config.platform == "ensemble" and config.max_batch_size == 64
        assert [list(i.dims) for i in config.input] == [[4]]
        steps = config.ensemble_scheduling.step
        assert [s.model_name for s in steps] == ["double", "plus_one", "add"]
        assert dict(steps[2].input_map) == {"A": "doubled", "B": "bumped"}
        assert dict(steps[2].output_map) == {"SUM": "OUT"}
        assert all(s.model_version == -1 for s in steps)


async def test_stage_models_are_served_through_the_router(served):
    async with inference_stub(served.router) as stub:
        meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="add"))
        assert [t.name for t in meta.inputs] == ["A", "B"]
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="add"))).config
        assert config.max_batch_size == 16
        assert (await stub.ModelReady(pb.ModelReadyRequest(name="add"))).ready
        assert (await stub.ModelReady(pb.ModelReadyRequest(name="diamond"))).ready
        response = await stub.ModelInfer(request_for("add", A=X, B=X))
        np.testing.assert_array_equal(response_tensors(response)["SUM"].to_array(), 2 * X)


async def test_deadline_and_metadata_reach_every_stage(served):
    served.recorder.calls.clear()
    async with inference_stub(served.router) as stub:
        await stub.ModelInfer(
            request_for("spied", X=X),
            timeout=7.5,
            metadata=(("x-tenant", "acme"), ("traceparent", "00-ab-cd-01")),
        )
    (call,) = served.recorder.calls
    # gRPC's timeout header rounds up to its unit, so allow a few milliseconds over.
    assert call.timeout is not None and 0 < call.timeout <= 7.55
    metadata = dict(call.metadata)
    assert metadata["x-tenant"] == "acme" and metadata["traceparent"] == "00-ab-cd-01"


async def test_a_slow_stage_gives_deadline_exceeded_and_the_router_keeps_serving(served):
    served.recorder.delay = 1.0
    try:
        async with inference_stub(served.router) as stub:
            err = await rpc_error(stub.ModelInfer(request_for("spied", X=X), timeout=0.3))
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        served.recorder.delay = 0.0
    async with inference_stub(served.router) as stub:
        await stub.ModelInfer(request_for("spied", X=X), timeout=5)


@pytest.mark.parametrize(
    ("request_", "code", "words"),
    [
        (request_for("nope", X=X), grpc.StatusCode.NOT_FOUND, ["nope", "diamond"]),
        (request_for("diamond", Y=X), grpc.StatusCode.INVALID_ARGUMENT, ["'Y'", "X"]),
        (
            request_for("diamond", X=X.astype(np.float64)),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["'X'", "FP32", "FP64"],
        ),
        (
            request_for("diamond", X=X.reshape(4, 2)),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["'X'", "[-1, 4]", "[4, 2]"],
        ),
        (
            request_for("diamond", X=np.full((2, 4), -5000, np.float32)),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["step 2 (add)", "A[0]"],
        ),
    ],
    ids=["unknown-ensemble", "wrong-input", "wrong-datatype", "wrong-shape", "stage-item-error"],
)
async def test_errors_are_clear_and_the_router_keeps_serving(served, request_, code, words):
    async with inference_stub(served.router) as stub:
        err = await rpc_error(stub.ModelInfer(request_, timeout=30))
        assert err.code() == code, err.details()
        for word in words:
            assert word in err.details()
        response = await stub.ModelInfer(request_for("diamond", X=X), timeout=30)
        np.testing.assert_array_equal(response_tensors(response)["OUT"].to_array(), 3 * X + 1)


async def until(predicate, timeout: float = 10.0) -> None:
    """Poll an async predicate (the router's health monitor runs every second)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


async def test_a_stage_that_is_down_is_named_and_the_router_recovers(tmp_path):
    async with serving_stages([Add()]) as math:
        (tmp_path / "solo.yaml").write_text(
            f"""
name: solo
stages: {{math: {{address: "{math.address}"}}}}
inputs: [{{name: A, datatype: FP32, shape: [-1, 4]}}]
outputs: [{{name: S, datatype: FP32, shape: [-1, 4]}}]
steps:
  - {{model_name: add, stage: math, input_map: {{A: A, B: A}}, output_map: {{SUM: S}}}}
"""
        )
        async with serving_router(load_ensembles([tmp_path])) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:

                async def ready() -> bool:
                    return (await stub.ServerReady(pb.ServerReadyRequest())).ready

                async def not_ready() -> bool:
                    return not await ready()

                await stub.ModelInfer(request_for("solo", A=X), timeout=10)
                await math.stop()
                err = await rpc_error(stub.ModelInfer(request_for("solo", A=X), timeout=10))
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert "stage 'math'" in err.details() and math.address in err.details()
                await until(not_ready)
                assert (await stub.ServerLive(pb.ServerLiveRequest())).live

                port = int(math.address.rsplit(":", 1)[1])
                async with serving_stages([Add()], port=port):
                    await until(ready)
                    response = await stub.ModelInfer(request_for("solo", A=X), timeout=10)
                    np.testing.assert_array_equal(response_tensors(response)["S"].to_array(), 2 * X)


async def test_a_type_mismatch_with_the_stage_stops_the_router_with_a_clear_error(tmp_path):
    async with serving_stages([Add()]) as math:
        await wait_serving(math.address)
        (tmp_path / "bad.yaml").write_text(
            f"""
name: bad
stages: {{math: {{address: "{math.address}"}}}}
inputs: [{{name: A, datatype: INT32, shape: [-1, 4]}}]
outputs: [{{name: S, datatype: FP32, shape: [-1, 4]}}]
steps:
  - {{model_name: add, stage: math, input_map: {{A: A, B: A}}, output_map: {{SUM: S}}}}
"""
        )
        args = router_settings_of(max_message_mb=4, grace_period=1)
        with pytest.raises(ConfigError) as info:
            await asyncio.wait_for(
                serve_router(args, catalog=load_ensembles([tmp_path]), stopping=asyncio.Event()), 20
            )
        message = str(info.value)
        assert "bad.yaml" in message and "step 0 (add)" in message and "'A'" in message and "INT32" in message

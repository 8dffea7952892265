"""Any OIP server as a stage: one that implements only the protocol's core RPCs, with no `grpc.health.v1`, no
`ModelConfig`, and a `ModelMetadata` that lists no tensors, as one branch of a fan-out ensemble; and one whose
`RepositoryIndex` writes its states as MLServer 1.7 does ("State.READY")."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.server import INFERENCE_SERVICE
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import health_status, inference_stub, request_for, rpc_error, wait_serving
from tests.stages import Scale


class PlainServicer(pb_grpc.GRPCInferenceServiceServicer):
    """`negate`: NEG = -X, answering with `datatype`. Every other RPC is the generated servicer's
    UNIMPLEMENTED, and the server registers no health service."""

    def __init__(self, datatype: str = "FP32") -> None:
        self.ready = True
        self.datatype = datatype

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.ready)

    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self.ready and request.name == "negate")

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="plain", version="0")

    async def ModelMetadata(self, request, context):
        if request.name != "negate":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name}")
        return pb.ModelMetadataResponse(name="negate", versions=["1"], platform="plain")

    async def ModelInfer(self, request, context):
        x = np.frombuffer(request.raw_input_contents[0], np.float32).reshape(tuple(request.inputs[0].shape))
        y = -x if self.datatype == "FP32" else (-x).astype(np.int32)
        response = pb.ModelInferResponse(model_name="negate", model_version="1", id=request.id)
        response.outputs.add(name="NEG", datatype=self.datatype, shape=list(y.shape))
        response.raw_output_contents.append(y.tobytes())
        return response


class MLServerLikeServicer(PlainServicer):
    """A `PlainServicer` with MLServer 1.7's `RepositoryIndex`: its states are Python's `str` of an enum
    member ("State.READY", "State.UNAVAILABLE"), and its entries carry no version."""

    async def RepositoryIndex(self, request, context):
        state = "State.READY" if self.ready else "State.UNAVAILABLE"
        if request.ready and not self.ready:
            return pb.RepositoryIndexResponse()
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(name="negate", state=state)]
        )


@contextlib.asynccontextmanager
async def plain_server(servicer: PlainServicer) -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def fan_out(folder: Path, ours: str, plain: str, *, name_stage: bool = True) -> None:
    """The ensemble `fan`: `scale` on our stage beside `negate` on the plain one (where `name_stage`, the step
    names its stage; else the router finds it in the stages' `RepositoryIndex`)."""
    on_plain = ", stage: plain" if name_stage else ""
    (folder / "fan.yaml").write_text(
        f"""
name: fan
max_batch_size: 8
stages: {{ours: {{address: "{ours}"}}, plain: {{address: "{plain}"}}}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: DOUBLED, datatype: FP32, shape: [-1, 3]}}, {{name: NEGATED, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: scale, stage: ours, input_map: {{X: X}}, output_map: {{Y: DOUBLED}}}}
  - {{model_name: negate{on_plain}, input_map: {{X: X}}, output_map: {{NEG: NEGATED}}}}
"""
    )


async def router_ready(stub, want: bool, timeout: float = 20.0) -> None:
    """Wait until the router's ServerReady says `want` (its monitor asks the stages every second)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (await stub.ServerReady(pb.ServerReadyRequest())).ready != want:
        assert loop.time() < deadline, f"the router's ServerReady did not become {want}"
        await asyncio.sleep(0.1)


X = np.array([[1, 2, 3], [4, 5, 6]], np.float32)


async def test_a_plain_oip_server_serves_one_branch_and_its_readiness_counts(tmp_path):
    plain = PlainServicer()
    async with serving_stages([Scale()]) as ours, plain_server(plain) as address:
        fan_out(tmp_path, ours.address, address)
        async with serving_router(load_ensembles([tmp_path])) as router:
            # It starts, and is ready, on the stage's ServerReady/ModelReady (the stage has no health service).
            await wait_serving(router.address)
            assert await health_status(router.address, INFERENCE_SERVICE) == 1
            async with inference_stub(router.address) as stub:
                await router_ready(stub, True)
                reply = await stub.ModelInfer(request_for("fan", X=X), timeout=10)
                out = {name: t.to_array() for name, t in response_tensors(reply).items()}
                np.testing.assert_array_equal(out["DOUBLED"], X * 2)
                np.testing.assert_array_equal(out["NEGATED"], -X)

                plain.ready = False  # the stage says, through the protocol, that it is not ready
                await router_ready(stub, False)
                assert not (await stub.ModelReady(pb.ModelReadyRequest(name="fan"))).ready
                plain.ready = True
                await router_ready(stub, True)
                reply = await stub.ModelInfer(request_for("fan", X=X[:1]), timeout=10)
                np.testing.assert_array_equal(response_tensors(reply)["NEGATED"].to_array(), -X[:1])


@pytest.mark.parametrize("name_stage", [True, False], ids=["step-names-stage", "found-in-index"])
async def test_a_stage_whose_index_writes_mlserver_states_serves(tmp_path, name_stage):
    """MLServer 1.7 answers `RepositoryIndex` with "State.READY": its `ModelReady` settles whether the model
    serves, so an ensemble with a step on it becomes ready and serves, and follows its readiness."""
    foreign = MLServerLikeServicer()
    async with serving_stages([Scale()]) as ours, plain_server(foreign) as address:
        fan_out(tmp_path, ours.address, address, name_stage=name_stage)
        async with serving_router(load_ensembles([tmp_path])) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                await router_ready(stub, True)
                reply = await stub.ModelInfer(request_for("fan", X=X), timeout=10)
                np.testing.assert_array_equal(response_tensors(reply)["NEGATED"].to_array(), -X)
                index = await stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
                assert {m.name for m in index.models} >= {"fan", "negate"}
                assert (await stub.ModelReady(pb.ModelReadyRequest(name="negate"))).ready

                foreign.ready = False
                await router_ready(stub, False)
                assert not (await stub.ModelReady(pb.ModelReadyRequest(name="fan"))).ready
                foreign.ready = True
                await router_ready(stub, True)
                reply = await stub.ModelInfer(request_for("fan", X=X[:1]), timeout=10)
                np.testing.assert_array_equal(response_tensors(reply)["NEGATED"].to_array(), -X[:1])


async def test_an_undeclared_signature_is_checked_on_the_first_response(tmp_path):
    async with serving_stages([Scale()]) as ours, plain_server(PlainServicer("INT32")) as address:
        fan_out(tmp_path, ours.address, address)
        async with serving_router(load_ensembles([tmp_path])) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                for _ in range(2):  # every request, until the stage answers what the ensemble expects
                    err = await rpc_error(stub.ModelInfer(request_for("fan", X=X), timeout=10))
                    assert err.code() == grpc.StatusCode.INTERNAL
                    message = err.details()
                    assert "step 1 (negate)" in message and "declares no tensors" in message, message
                    assert "ensemble output 'NEGATED': datatype FP32" in message and "INT32" in message, (
                        message
                    )
                assert (await stub.ServerLive(pb.ServerLiveRequest())).live

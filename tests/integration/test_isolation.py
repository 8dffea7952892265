"""One model's trouble stays its own: the models of one stage share the router's link to it (a frame
connection, or a `ModelStreamInfer` stream) and the router's door, and a model whose requests pile up (a slow
or stuck model, a flood of requests) must not hold either for the others. Here the piled-up model is stuck
until the test releases it, so a request to another model that waited behind it would never be answered."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.admission import ModelShares
from pipeline.runtime.metrics import Metrics
from pipeline.tools.testing import serving_router, serving_stages
from pipeline.transport.server_link import ServerLink
from tests.conftest import inference_stub, request_for, wait_serving
from tests.stages import Held, Scale

FRAMES = {"frames_port": 0}
#: More requests of the stuck model than a connection held at once before: 64.
PILED_UP = 100


def _catalog(folder: Path, address: str):
    """The router's catalog: an ensemble of each model of the stage at `address`, which tells the router
    where both models are (it calls them by name here)."""
    for model in ("stuck", "scale"):
        (folder / f"{model}_alone.yaml").write_text(
            f"""
name: {model}_alone
stages:
  s: {{address: "{address}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: {model}, stage: s, input_map: {{X: X}}, output_map: {{Y: Y}}}}
"""
        )
    return load_ensembles([folder])


async def _ready(address: str, *models: str) -> None:
    """Wait until the stage at `address` is serving and its `models` are loaded."""
    await wait_serving(address)
    async with inference_stub(address) as stub:
        for _ in range(2000):
            ready = [await stub.ModelReady(pb.ModelReadyRequest(name=m)) for m in models]
            if all(r.ready for r in ready):
                return
            await asyncio.sleep(0.01)
    pytest.fail(f"{models} never became ready")


async def _calls_in_flight(metrics: Metrics, count: int) -> None:
    """Wait until the router has `count` calls in flight to its stages."""
    for _ in range(2000):
        held = sum(
            sample.value
            for family in metrics.registry.collect()
            if family.name == "pipeline_stage_inflight_calls"
            for sample in family.samples
        )
        if held == count:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"the router never had {count} calls in flight to its stages")


def _row(value: float) -> np.ndarray:
    return np.full((1, 3), value, np.float32)


async def _scaled(stub, value: float) -> None:
    """A request to the other model of the stage is answered, and right."""
    reply = await stub.ModelInfer(request_for("scale", "other", X=_row(value)), timeout=20)
    np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), _row(value) * 2)


@pytest.mark.parametrize("options", [FRAMES, {}], ids=["frame port", "shared stream"])
async def test_a_stuck_model_does_not_hold_the_routers_link_for_the_other_models_of_its_stage(
    options: dict, tmp_path: Path
) -> None:
    stuck = Held("stuck")
    async with serving_stages([stuck, Scale()], options=options) as stage:
        await _ready(stage.address, "stuck", "scale")
        async with serving_router(_catalog(tmp_path, stage.address)) as router:
            await _ready(router.address, "stuck", "scale")
            async with inference_stub(router.address) as stub:
                await _scaled(stub, 1.0)  # the router has learnt both models and holds its link
                piled = [
                    asyncio.ensure_future(
                        stub.ModelInfer(request_for("stuck", f"s{i}", X=_row(i)), timeout=60)
                    )
                    for i in range(PILED_UP)
                ]
                assert await asyncio.to_thread(stuck.entered.wait, 20)
                try:
                    await _scaled(stub, 3.0)
                finally:
                    stuck.release.set()
                replies = await asyncio.gather(*piled)
            assert [r.id for r in replies] == [f"s{i}" for i in range(PILED_UP)]


async def test_a_model_past_its_share_of_a_connection_is_refused_at_once_and_the_others_still_served(
    monkeypatch,
) -> None:
    monkeypatch.setattr(ModelShares, "max_requests", 8)
    stuck = Held("stuck")
    async with serving_stages([stuck, Scale()], options=FRAMES) as stage:
        await _ready(stage.address, "stuck", "scale")
        async with grpc.aio.insecure_channel(stage.address) as channel:
            frames = await ServerLink(stage.address, channel, (), 1 << 26).frame_connection()
            assert frames is not None
            held = [
                asyncio.ensure_future(frames.infer(request_for("stuck", f"s{i}", X=_row(i)), 60.0, {}))
                for i in range(8)
            ]
            assert await asyncio.to_thread(stuck.entered.wait, 20)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await frames.infer(request_for("stuck", "one-too-many", X=_row(9)), 60.0, {})
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "model 'stuck' has 8 requests" in (refused.value.details() or "")
            reply = await frames.infer(request_for("scale", "other", X=_row(2)), 20.0, {})
            np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), _row(4))
            stuck.release.set()
            assert len(await asyncio.gather(*held)) == 8
            # Its share is free again once answered.
            reply = await frames.infer(request_for("stuck", "again", X=_row(5)), 20.0, {})
            assert reply.id == "again"
            frames.close()


async def test_a_model_holds_at_most_three_quarters_of_the_routers_door(tmp_path: Path) -> None:
    stuck = Held("stuck")
    async with serving_stages([stuck, Scale()], options=FRAMES) as stage:
        await _ready(stage.address, "stuck", "scale")
        catalog = _catalog(tmp_path, stage.address)
        metrics = Metrics()
        async with serving_router(catalog, metrics=metrics, options={"max_inflight_requests": 8}) as router:
            await _ready(router.address, "stuck", "scale")
            async with inference_stub(router.address) as stub:
                await _scaled(stub, 1.0)
                held = [
                    asyncio.ensure_future(
                        stub.ModelInfer(request_for("stuck", f"s{i}", X=_row(i)), timeout=60)
                    )
                    for i in range(6)
                ]
                await _calls_in_flight(metrics, 6)
                # The seventh is refused at the door; the other model's requests are not.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ModelInfer(request_for("stuck", "seventh", X=_row(9)), timeout=60)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "model 'stuck' has 6 requests in flight at the router" in (
                    refused.value.details() or ""
                )
                await _scaled(stub, 2.0)
                stuck.release.set()
                assert len(await asyncio.gather(*held)) == 6

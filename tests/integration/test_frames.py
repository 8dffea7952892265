"""The router's fast path to this project's stages: the protocol's messages in frames on a plain stream
(a stage's frame port), with what a client sees exactly as over gRPC: results, refused items with their
details, deadlines, a connection cut off, and tokens."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.frames import port_of
from pipeline.router.stages.stage_client import item_errors
from pipeline.tools.testing import serving_router, serving_stages
from pipeline.transport.frame_client import FrameConnection
from pipeline.transport.server_link import ServerLink
from tests.conftest import inference_stub, request_for, wait_serving
from tests.stages import Held, Scale

FRAMES = {"frames_port": 0}


async def _connection(address: str, channel: grpc.aio.Channel) -> FrameConnection:
    frames = await ServerLink(address, channel, (), 1 << 26).frame_connection()
    assert frames is not None
    return frames


async def test_a_stage_names_its_frame_port_and_answers_every_request_on_it() -> None:
    async with serving_stages([Scale()], options=FRAMES) as stage:
        await wait_serving(stage.address)
        async with inference_stub(stage.address) as stub:
            meta = await stub.ServerMetadata(pb.ServerMetadataRequest())
            assert port_of(tuple(meta.extensions)) is not None
        async with grpc.aio.insecure_channel(stage.address) as channel:
            frames = await _connection(stage.address, channel)
            rows = [np.full((1, 3), i, np.float32) for i in range(40)]
            requests = [request_for("scale", f"mine-{i}", X=row) for i, row in enumerate(rows)]
            replies = await asyncio.gather(*(frames.infer(r, 10.0, {}) for r in requests))
            for i, reply in enumerate(replies):
                assert reply.id == f"mine-{i}"
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), rows[i] * 2)
            assert all(not r.parameters for r in requests)  # nothing of the hop left on them
            frames.close()


async def test_a_refused_item_comes_back_as_the_unary_call_says_it() -> None:
    async with serving_stages([Scale()], options=FRAMES) as stage:
        await wait_serving(stage.address)
        async with grpc.aio.insecure_channel(stage.address) as channel:
            frames = await _connection(stage.address, channel)
            x = np.array([[1, 2, 3], [-1, 0, 0]], np.float32)
            with pytest.raises(grpc.aio.AioRpcError) as framed:
                await frames.infer(request_for("scale", X=x), 10.0, {})
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request_for("scale", X=x))
            assert framed.value.code() == unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert framed.value.details() == unary.value.details()
            assert item_errors(framed.value) == item_errors(unary.value)
            reply = await frames.infer(request_for("scale", X=x[:1]), 10.0, {})
            np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), x[:1] * 2)
            frames.close()


async def test_a_request_past_its_deadline_fails_alone_and_a_cut_connection_fails_its_requests() -> None:
    held = Held()
    async with serving_stages([held], options=FRAMES) as stage:
        await wait_serving(stage.address)
        async with grpc.aio.insecure_channel(stage.address) as channel:
            frames = await _connection(stage.address, channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await frames.infer(request_for("held", X=np.zeros((1, 3), np.float32)), 0.2, {})
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            pending = asyncio.ensure_future(
                frames.infer(request_for("held", X=np.ones((1, 3), np.float32)), 10.0, {})
            )
            await asyncio.sleep(0)  # it is on its way
            frames.close()
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await pending
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not frames.usable
            held.release.set()


async def test_the_router_calls_its_stages_on_their_frame_ports(tmp_path) -> None:
    async with serving_stages([Scale()], options=FRAMES) as stage:
        (tmp_path / "e.yaml").write_text(
            f"""
name: e
stages:
  s: {{address: "{stage.address}", dynamic_batching: {{max_batch_size: 8}}}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: scale, stage: s, input_map: {{X: X}}, output_map: {{Y: Y}}}}
"""
        )
        async with serving_router(load_ensembles([tmp_path])) as router:
            await wait_serving(router.address)
            xs = [np.full((1, 3), i, np.float32) for i in range(16)]
            async with inference_stub(router.address) as stub:
                replies = await asyncio.gather(
                    *(stub.ModelInfer(request_for("e", X=x), timeout=10) for x in xs)
                )
                for x, reply in zip(xs, replies, strict=True):
                    np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), x * 2)
                bad = await asyncio.gather(
                    stub.ModelInfer(request_for("e", X=-np.ones((1, 3), np.float32)), timeout=10),
                    return_exceptions=True,
                )
                assert isinstance(bad[0], grpc.aio.AioRpcError)
                assert bad[0].code() == grpc.StatusCode.INVALID_ARGUMENT
            # The stage served them on its frame port: its statistics count them, its gRPC calls do not.
            async with inference_stub(stage.address) as stub:
                stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="scale"))
            assert stats.model_stats[0].inference_count >= 16


async def test_a_frame_port_refuses_a_connection_without_a_token_where_the_stage_asks_for_one(
    tmp_path,
) -> None:
    (tmp_path / "users").write_text("someone\n")
    options = {**FRAMES, "auth_tokens_file": str(tmp_path / "users"), "stage_token": "router-secret"}
    async with serving_stages([Scale()], options=options) as stage:
        await wait_serving(stage.address)
        token = (("authorization", "Bearer router-secret"),)
        async with grpc.aio.insecure_channel(stage.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            meta = await stub.ServerMetadata(pb.ServerMetadataRequest(), metadata=token)
            port = port_of(tuple(meta.extensions))
            assert port is not None
            for wrong in ((), (("authorization", "Bearer guess"),)):
                with pytest.raises(
                    ConnectionError, match="refused its hello: missing or invalid credentials"
                ):
                    await FrameConnection.open("127.0.0.1", port, wrong, 1 << 26)
            frames = await ServerLink(stage.address, channel, token, 1 << 26).frame_connection()
            assert frames is not None
            reply = await frames.infer(request_for("scale", X=np.ones((1, 3), np.float32)), 10.0, {})
            assert response_tensors(reply)["Y"].to_array().tolist() == [[2, 2, 2]]
            frames.close()


async def test_a_stopping_stage_answers_what_it_holds_refuses_the_rest_and_no_idle_connection_holds_it() -> (
    None
):
    held = Held()
    async with serving_stages([held, Scale()], options=FRAMES, grace=60) as stage:
        await wait_serving(stage.address)
        async with grpc.aio.insecure_channel(stage.address) as channel:
            busy, idle = await _connection(stage.address, channel), await _connection(stage.address, channel)
            x = np.ones((1, 3), np.float32)
            holding = asyncio.ensure_future(busy.infer(request_for("held", X=x), 30.0, {}))
            assert await asyncio.to_thread(held.entered.wait, 30)
            stopping = asyncio.ensure_future(stage.stop())
            for _ in range(10_000):  # each try is a round trip: the stage starts refusing within a few
                try:
                    await idle.infer(request_for("scale", X=x), 10.0, {})
                except grpc.aio.AioRpcError as err:
                    refused = err
                    break
            else:
                pytest.fail("a stopping stage still took new requests")
            assert refused.code() == grpc.StatusCode.UNAVAILABLE and refused.details() == (
                "the server is shutting down"
            )
            assert not stopping.done(), "the request in flight has its grace"
            held.release.set()
            reply = await holding
            assert response_tensors(reply)["Y"].to_array().tolist() == [[1, 1, 1]]
            # Well within its 60 s of grace: the idle connection did not hold the stage up.
            await asyncio.wait_for(stopping, 30)

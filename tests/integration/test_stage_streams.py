"""Stage calls over a long-lived ModelStreamInfer stream: responses matched by id, errors with their
status details, deadlines, and the unary path kept for servers that do not carry a streamed status."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.errors import Unavailable
from pipeline.protocol.types import TensorSpec
from pipeline.router.stages.stage_client import item_errors, not_started
from pipeline.runtime.data_plane import RequestContext
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_stages
from pipeline.transport.server_link import ServerLink
from tests.conftest import request_for, wait_serving
from tests.integration.test_faults import Slow, serve_plane
from tests.integration.test_plain_oip_stage import PlainServicer, plain_server
from tests.stages import Scale


class Held(Stage):
    """Y = X; a request waits until `release` is set."""

    name = "held"
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def __init__(self) -> None:
        self.release = threading.Event()

    def infer(self, inputs):
        assert self.release.wait(30)
        return {"Y": inputs["X"]}


async def test_requests_on_one_stream_get_their_own_responses() -> None:
    async with serving_stages([Scale()]) as stage:
        await wait_serving(stage.address)
        async with grpc.aio.insecure_channel(stage.address) as channel:
            link = ServerLink(stage.address, channel, (), 1 << 26)
            stream = await link.shared_stream()
            assert stream is not None and link.transport == "stream"
            rows = [np.full((1, 3), i, np.float32) for i in range(20)]
            requests = [request_for("scale", f"mine-{i}", X=row) for i, row in enumerate(rows)]
            replies = await asyncio.gather(*(stream.infer(r, 10.0, {}) for r in requests))
            for i, reply in enumerate(replies):
                assert reply.id == f"mine-{i}"  # the caller's id back, whatever the stream used
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), rows[i] * 2)
            assert all(not r.parameters for r in requests)  # nothing of the hop left on them
            await stream.close()


async def test_a_refused_item_comes_back_as_the_unary_call_says_it() -> None:
    async with serving_stages([Scale()]) as stage:
        await wait_serving(stage.address)
        async with grpc.aio.insecure_channel(stage.address) as channel:
            stream = await ServerLink(stage.address, channel, (), 1 << 26).shared_stream()
            assert stream is not None
            x = np.array([[1, 2, 3], [-1, 0, 0]], np.float32)
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                await stream.infer(request_for("scale", X=x), 10.0, {})
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request_for("scale", X=x))
            assert streamed.value.code() == unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert streamed.value.details() == unary.value.details()
            assert "negative values are not allowed" in (streamed.value.details() or "")
            assert item_errors(streamed.value) == item_errors(unary.value)
            # The stream goes on serving.
            reply = await stream.infer(request_for("scale", X=x[:1]), 10.0, {})
            np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), x[:1] * 2)
            await stream.close()


class Refusing(Slow):
    """Refuses every inference before starting it (a model not loaded yet, a full queue)."""

    async def infer(self, request, call: RequestContext):
        raise Unavailable("not loaded yet")


async def test_a_refusal_before_the_call_started_keeps_its_not_started_detail() -> None:
    # UNAVAILABLE with ErrorInfo NOT_STARTED: the detail survives the stream, so the router still sends the
    # call to another replica at once, as it does for a unary refusal.
    server, address = await serve_plane(Refusing())
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stream = await ServerLink(address, channel, (), 1 << 26).shared_stream()
            assert stream is not None
            request = request_for("slow", X=np.zeros((1, 3), np.float32))
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                await stream.infer(request, 10.0, {})
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
            assert streamed.value.code() == unary.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not_started(streamed.value) and not_started(unary.value)
            await stream.close()
    finally:
        await server.stop(0)


async def test_a_request_past_its_deadline_fails_alone() -> None:
    held = Held()
    async with serving_stages([held]) as stage:
        await wait_serving(stage.address)
        async with grpc.aio.insecure_channel(stage.address) as channel:
            stream = await ServerLink(stage.address, channel, (), 1 << 26).shared_stream()
            assert stream is not None
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stream.infer(request_for("held", X=np.zeros((1, 3), np.float32)), 0.2, {})
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            held.release.set()
            reply = await stream.infer(request_for("held", X=np.ones((1, 3), np.float32)), 10.0, {})
            assert response_tensors(reply)["Y"].to_array().tolist() == [[1, 1, 1]]
            await stream.close()


async def test_a_stream_cut_off_fails_its_requests_as_unavailable() -> None:
    held = Held()
    async with serving_stages([held]) as stage:
        await wait_serving(stage.address)
        async with grpc.aio.insecure_channel(stage.address) as channel:
            stream = await ServerLink(stage.address, channel, (), 1 << 26).shared_stream()
            assert stream is not None
            pending = asyncio.ensure_future(
                stream.infer(request_for("held", X=np.zeros((1, 3), np.float32)), 10.0, {})
            )
            stream.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pending
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not stream.fresh
            held.release.set()


async def test_a_server_that_does_not_carry_a_streamed_status_gets_unary_calls() -> None:
    async with plain_server(PlainServicer()) as address, grpc.aio.insecure_channel(address) as channel:
        link = ServerLink(address, channel, (), 1 << 26)
        assert await link.shared_stream() is None
        assert link.transport == "unary"

"""The stage-transport seam (`pipeline.transport.server_link`): how a server's `ModelInfer` calls travel is
chosen in one place, by what the server offers: its frame port, else one shared stream, else unary calls."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.frames import extension as frames_extension
from pipeline.stage import Stage, TensorSpec
from pipeline.tools.testing import serving_stages
from pipeline.transport import ConnectionRecycled, ServerLink, grpc_stream, server_link
from tests.conftest import request_for, wait_serving
from tests.integration.test_plain_oip_stage import PlainServicer, plain_server
from tests.stages import Scale

X = np.array([[1, 2, 3]], np.float32)


async def _scaled(link: ServerLink, metadata: tuple[tuple[str, str], ...] = ()) -> None:
    reply = await link.infer(request_for("scale", X=X), 10.0, metadata)
    np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), X * 2)


@pytest.mark.parametrize(("options", "transport"), [({"frames_port": 0}, "frames"), ({}, "stream")])
async def test_a_stage_is_called_the_cheapest_way_it_offers(options, transport, monkeypatch) -> None:
    async with serving_stages([Scale()], options=options) as stage:
        await wait_serving(stage.address)
        async with grpc.aio.insecure_channel(stage.address) as channel:
            link = ServerLink(stage.address, channel, (), 1 << 26)
            assert link.transport == "unknown"
            await _scaled(link)
            assert link.transport == transport
            matched = await (link.frame_connection() if transport == "frames" else link.shared_stream())
            assert matched is not None
            carried = []
            infer = matched.infer
            monkeypatch.setattr(matched, "infer", lambda *args: carried.append(args) or infer(*args))
            # A client's own metadata cannot travel in a frame or a shared stream: a unary call carries it.
            await _scaled(link, (("x-client", "mine"),))
            assert not carried
            await _scaled(link, (("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),))
            assert len(carried) == 1  # the trace context travels in the request's parameters
            link.close()


async def test_a_server_that_offers_neither_gets_unary_calls() -> None:
    async with plain_server(PlainServicer()) as address, grpc.aio.insecure_channel(address) as channel:
        link = ServerLink(address, channel, (), 1 << 26)
        request = request_for("negate", X=X)
        reply = await link.infer(request, 10.0, ())
        np.testing.assert_array_equal(response_tensors(reply)["NEG"].to_array(), -X)
        assert link.transport == "unary"


class _NamesAFramePort(PlainServicer):
    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="plain", version="0", extensions=[frames_extension(self.port)])


async def test_a_frame_port_that_cannot_be_used_is_tried_again_after_a_while(monkeypatch) -> None:
    accepted = 0

    def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        writer.close()  # no hello answered: the port cannot be used

    port_server = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = port_server.sockets[0].getsockname()[1]
    try:
        async with (
            plain_server(_NamesAFramePort(port)) as address,
            grpc.aio.insecure_channel(address) as channel,
        ):
            link = ServerLink(address, channel, (), 1 << 26)
            for _ in range(2):  # the second call does not try the port again: gRPC carries it
                reply = await link.infer(request_for("negate", X=X), 10.0, ())
                np.testing.assert_array_equal(response_tensors(reply)["NEG"].to_array(), -X)
            assert accepted == 1 and link.transport == "unary"
            monkeypatch.setattr(server_link, "FRAMES_RETRY_S", 0.0)
            await link.infer(request_for("negate", X=X), 10.0, ())
            assert accepted == 2
    finally:
        port_server.close()
        await port_server.wait_closed()


async def test_an_idle_stream_is_closed_and_the_next_call_opens_another(monkeypatch) -> None:
    monkeypatch.setattr(grpc_stream, "IDLE_S", 0.0)
    async with serving_stages([Scale()]) as stage:
        await wait_serving(stage.address)
        async with grpc.aio.insecure_channel(stage.address) as channel:
            link = ServerLink(stage.address, channel, (), 1 << 26)
            first = await link.shared_stream()
            assert first is not None
            await _scaled(link)  # on `first`
            # Idle at once: it stops sending, and the server ends the stream once it has answered.
            await asyncio.wait_for(first.closed(), 10.0)
            assert not first.fresh
            await _scaled(link)
            second = await link.shared_stream()
            assert second is not None and second is not first
            link.close()


class _Held(Stage):
    """Answers once `release` is set; `entered` says a call has come."""

    name = "held"
    inputs = (TensorSpec("X", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def infer(self, inputs):
        self.entered.set()
        self.release.wait(30)
        return {"Y": inputs["X"]}


@pytest.mark.parametrize(("options", "transport"), [({"frames_port": 0}, "frames"), ({}, "stream")])
async def test_a_connection_that_ends_under_a_call_is_reported_alike_whichever_carried_it(
    options, transport
) -> None:
    # The router retries such a call at once and keeps the replica: it must not tell the transports apart.
    held = _Held()
    async with serving_stages([held], options=options) as stage:
        await wait_serving(stage.address)
        async with grpc.aio.insecure_channel(stage.address) as channel:
            link = ServerLink(stage.address, channel, (), 1 << 26)
            call = asyncio.ensure_future(link.infer(request_for("held", X=X), 10.0, ()))
            try:
                assert await asyncio.to_thread(held.entered.wait, 10)
                assert link.transport == transport
                link.close()  # its connection ends with the call in flight
                with pytest.raises(ConnectionRecycled) as cut:
                    await call
                assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                held.release.set()

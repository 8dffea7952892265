"""Work whose deadline has passed is dropped by the stage runtime: a queued batch is never started, and a
stage that checks `expired()` between items stops when its client has gone. And `digits_preprocess`'s pixel
budget answers a full batch of refusals within a gRPC trailer."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Mapping

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pipeline.protocol.errors import DeadlineExceeded
from pipeline.runtime.data_plane import RequestContext
from pipeline.stage import Stage, TensorSpec
from pipeline.stage.stage_plane import StagePlane
from pipeline.tools.testing import serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.stages import example_stage
from tests.unit.test_preprocess import _png_header_only, batch, encode


class ManualClock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Gated(Stage):
    """Records each call's first value; a call of value 0 holds the instance until `release` is set."""

    name = "gated"
    max_batch_size = 4
    inputs = (TensorSpec("X", "FP32", (-1, 1)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 1)),)

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        value = float(inputs["X"][0, 0])
        self.calls.append(value)
        if value == 0:
            self.entered.set()
            self.release.wait(30)
        return {"Y": inputs["X"]}


def _x(value: float) -> np.ndarray:
    return np.full((1, 1), value, np.float32)


async def test_a_queued_batch_whose_deadline_passes_is_never_run() -> None:
    clock = ManualClock()
    stage = Gated()
    plane = StagePlane([stage], clock=clock)
    await plane.load()
    try:
        no_deadline = RequestContext(None, ())
        holding = asyncio.create_task(plane.infer(request_for("gated", X=_x(0)), no_deadline))
        await asyncio.to_thread(stage.entered.wait, 30)
        # Queued behind the held call, with 5 s to live; then 10 s pass before the instance is free.
        queued = asyncio.create_task(plane.infer(request_for("gated", X=_x(1)), RequestContext(5.0, ())))
        in_time = asyncio.create_task(plane.infer(request_for("gated", X=_x(2)), RequestContext(60.0, ())))
        await asyncio.sleep(
            0
        )  # one turn of the loop: both have taken their deadline and wait for the instance
        clock.now += 10
        stage.release.set()
        await holding
        with pytest.raises(DeadlineExceeded, match="before the batch started: it was not run"):
            await queued
        await in_time
        assert stage.calls == [0, 2], "the expired batch never reached the stage"
        reply = await plane.statistics("gated", "")
        assert reply.model_stats[0].inference_stats.fail.count == 1
    finally:
        stage.release.set()
        await plane.unload()


async def test_a_call_already_past_its_deadline_is_not_started() -> None:
    stage = Gated()
    plane = StagePlane([stage])
    await plane.load()
    try:
        with pytest.raises(DeadlineExceeded):
            await plane.infer(request_for("gated", X=_x(1)), RequestContext(0.0, ()))
        assert stage.calls == []
    finally:
        await plane.unload()


async def test_the_digits_preprocess_stops_decoding_when_its_client_has_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stage = example_stage("digits_preprocess")
    module = sys.modules[type(stage).__module__]
    decode = module._decode_one
    decoded: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def held_decode(image, where):
        decoded.append(where)
        if len(decoded) == 1:  # the first image of the big batch holds on until its client has gone
            entered.set()
            release.wait(30)
            # The client saw its deadline pass; the stage's copy of it, sent over the wire as time left, ends
            # a little later (by the request's transit): hold on until the stage knows too, as a longer
            # decode would.
            gone = time.monotonic() + 30
            while not stage.expired() and time.monotonic() < gone:
                time.sleep(0.001)
        return decode(image, where)

    monkeypatch.setattr(module, "_decode_one", held_decode)
    image = encode(np.eye(8, dtype=np.uint8) * 255, size=64)
    async with serving_stages([stage]) as served, inference_stub(served.address) as stub:
        await wait_serving(served.address)
        big = request_for("digits_preprocess", IMAGE=batch(*[image] * 20)["IMAGE"])
        call = asyncio.ensure_future(stub.ModelInfer(big, timeout=1.0))
        await asyncio.to_thread(entered.wait, 30)
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        release.set()
        # The next request runs once the instance is free: by then the big batch has stopped.
        await stub.ModelInfer(request_for("digits_preprocess", IMAGE=batch(image)["IMAGE"]), timeout=30)
        assert decoded == ["IMAGE[0]", "IMAGE[0]"], "one image of the 20, then the next request's"


async def test_a_full_batch_past_the_pixel_budget_is_refused_item_by_item_over_grpc() -> None:
    # 256 images that claim 4000×4000 each: 4 fit the default budget of 64 M pixels, 252 are refused, the
    # first of them named in the details, as many as fit a client's trailer limit (past it the call would
    # fail RESOURCE_EXHAUSTED); a router sends the rest again.
    stage = example_stage("digits_preprocess")
    images = batch(*[_png_header_only(4000, 4000)] * 256)["IMAGE"]
    async with serving_stages([stage]) as served, inference_stub(served.address) as stub:
        await wait_serving(served.address)
        error = await rpc_error(stub.ModelInfer(request_for("digits_preprocess", IMAGE=images), timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "over the batch's pixel budget" in error.details()
        [detail] = rpc_status.from_call(error).details
        refused = error_details_pb2.BadRequest()
        detail.Unpack(refused)
        named = [v.field for v in refused.field_violations]
        assert 50 < len(named) < 252
        assert named == [f"IMAGE[{i}]" for i in range(4, 4 + len(named))]

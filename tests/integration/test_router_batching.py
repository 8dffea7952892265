"""Dynamic batching through real servers: what the stage sees, per its own statistics."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.types import TensorSpec
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.stages import Scale


class RowSum(Stage):
    """Sums variable-length rows: TOKENS are padded with 0 in a batch; ECHO gives each request its own extent."""

    name = "rowsum"
    max_batch_size = 32
    inputs = (TensorSpec("TOKENS", "INT64", (-1, -1), pad_value=0),)
    outputs = (TensorSpec("SUM", "INT64", (-1, 1)), TensorSpec("ECHO", "INT64", (-1, -1), pad_value=0))

    def __init__(self) -> None:
        self.widths: list[int] = []

    def infer(self, inputs):
        tokens = inputs["TOKENS"]
        self.widths.append(tokens.shape[1])
        return {"SUM": tokens.sum(axis=1, keepdims=True), "ECHO": tokens + 0}


class Gate(Stage):
    """Holds each call until released: keeps the only slot busy so that a queue builds."""

    name = "gate"
    max_batch_size = 4
    inputs = (TensorSpec("X", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def infer(self, inputs):
        self.entered.set()
        assert self.release.wait(20)
        return {"Y": inputs["X"]}


ENSEMBLES = {
    "batched": """
name: batched
stages:
  s:
    address: "{address}"
    dynamic_batching: {{max_batch_size: 6, max_queue_delay_microseconds: 30000000, idle_dispatch: false}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: scale, stage: s, input_map: {{X: X}}, output_map: {{Y: Y}}}}
""",
    "ragged": """
name: ragged
stages:
  s:
    address: "{address}"
    dynamic_batching: {{max_batch_size: 3, max_queue_delay_microseconds: 30000000, idle_dispatch: false}}
inputs: [{{name: T, datatype: INT64, shape: [-1, -1]}}]
outputs: [{{name: S, datatype: INT64, shape: [-1, 1]}}, {{name: E, datatype: INT64, shape: [-1, -1]}}]
steps:
  - {{model_name: rowsum, stage: s, input_map: {{TOKENS: T}}, output_map: {{SUM: S, ECHO: E}}}}
""",
    "gated": """
name: gated
stages:
  s:
    address: "{address}"
    dynamic_batching: {{max_batch_size: 4, max_queue_size: 2, max_inflight_batches: 1}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: gate, stage: s, input_map: {{X: X}}, output_map: {{Y: Y}}}}
""",
}

UNBATCHED = """
name: unbatched
stages:
  t: {{address: "{address}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: plain_scale, stage: t, input_map: {{X: X}}, output_map: {{Y: Y}}}}
"""


class Served:
    def __init__(self, router: str, stage: str, unbatched_stage: str, rowsum: RowSum, gate: Gate) -> None:
        self.router, self.stage, self.unbatched_stage = router, stage, unbatched_stage
        self.rowsum, self.gate = rowsum, gate


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batching")
    rowsum, gate = RowSum(), Gate()
    async with (
        serving_stages([Scale(), rowsum, gate]) as stage,
        serving_stages([Scale("plain_scale")]) as plain,
    ):
        for name, text in ENSEMBLES.items():
            (folder / f"{name}.yaml").write_text(text.format(address=stage.address))
        other = tmp_path_factory.mktemp("unbatched")
        (other / "unbatched.yaml").write_text(UNBATCHED.format(address=plain.address))
        async with serving_router(load_ensembles([folder, other])) as router:
            await wait_serving(router.address)
            yield Served(router.address, stage.address, plain.address, rowsum, gate)


async def stage_batches(address: str, model: str) -> dict[int, int]:
    """Batch size -> executions, from the stage's own ModelStatistics."""
    async with inference_stub(address) as stub:
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))
    return {b.batch_size: b.compute_infer.count for b in reply.model_stats[0].batch_stats}


async def test_concurrent_requests_reach_the_stage_as_one_batch(served):
    before = await stage_batches(served.stage, "scale")
    xs = [np.full((n, 3), i + 1, np.float32) for i, n in enumerate((1, 2, 3))]
    async with inference_stub(served.router) as stub:
        replies = await asyncio.gather(
            *(stub.ModelInfer(request_for("batched", X=x), timeout=20) for x in xs)
        )
    for x, reply in zip(xs, replies, strict=True):
        np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 2 * x)
    after = await stage_batches(served.stage, "scale")
    assert after.get(6, 0) - before.get(6, 0) == 1, after  # three requests, six items, one execution


async def test_batching_off_sends_one_request_per_call(served):
    xs = [np.full((1, 3), i, np.float32) for i in range(4)]
    async with inference_stub(served.router) as stub:
        await asyncio.gather(*(stub.ModelInfer(request_for("unbatched", X=x), timeout=20) for x in xs))
    assert await stage_batches(served.unbatched_stage, "plain_scale") == {1: 4}


async def test_ragged_requests_are_padded_together_and_cut_back(served):
    rows = [np.array([[1, 2, 3, 4, 5]]), np.array([[7]]), np.array([[1, 1, 1]])]
    served.rowsum.widths.clear()
    async with inference_stub(served.router) as stub:
        replies = await asyncio.gather(
            *(stub.ModelInfer(request_for("ragged", T=r), timeout=20) for r in rows)
        )
    assert served.rowsum.widths == [5], "one batch, padded to the longest request"
    for row, reply in zip(rows, replies, strict=True):
        out = response_tensors(reply)
        assert out["S"].to_array().tolist() == [[int(row.sum())]]
        np.testing.assert_array_equal(out["E"].to_array(), row)  # its own length, not the batch's


async def test_one_bad_item_fails_only_its_own_request(served):
    xs = [
        np.ones((2, 3), np.float32),
        np.array([[1, 1, 1], [-1, 0, 0]], np.float32),
        np.ones((2, 3), np.float32),
    ]
    async with inference_stub(served.router) as stub:
        results = await asyncio.gather(
            *(stub.ModelInfer(request_for("batched", X=x), timeout=20) for x in xs), return_exceptions=True
        )
    assert not isinstance(results[0], BaseException) and not isinstance(results[2], BaseException)
    err = results[1]
    assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "X[1]" in err.details(), "the index is the request's own row, not the batch's"
    assert "step 0 (scale)" in err.details()


async def test_a_request_larger_than_max_batch_size_is_refused(served):
    async with inference_stub(served.router) as stub:
        err = await rpc_error(
            stub.ModelInfer(request_for("batched", X=np.ones((7, 3), np.float32)), timeout=20)
        )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch size 7 exceeds max_batch_size 6" in err.details()


async def test_a_full_queue_is_unavailable_at_once_naming_the_stage(served):
    x = np.ones((1, 3), np.float32)
    async with inference_stub(served.router) as stub:
        first = asyncio.ensure_future(stub.ModelInfer(request_for("gated", X=x), timeout=30))
        assert await asyncio.to_thread(served.gate.entered.wait, 10)
        queued = [
            asyncio.ensure_future(stub.ModelInfer(request_for("gated", X=x), timeout=30)) for _ in range(2)
        ]
        errors = []
        for _ in range(50):  # the queue fills once both have reached the router
            try:
                await stub.ModelInfer(request_for("gated", X=x), timeout=30)
            except grpc.aio.AioRpcError as err:
                errors.append(err)
                break
            await asyncio.sleep(0.05)
        assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE
        assert "stage 's' (model 'gate') is saturated" in errors[0].details()
        served.gate.release.set()
        for reply in await asyncio.gather(first, *queued):
            np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), x)


async def test_router_statistics_count_every_request(served):
    async with inference_stub(served.router) as stub:
        before = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="batched"))).model_stats[0]
        for _ in range(3):  # full batches (6 items): each goes at once
            await stub.ModelInfer(request_for("batched", X=np.ones((6, 3), np.float32)), timeout=20)
        after = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="batched"))).model_stats[0]
        member = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="scale"))).model_stats[0]
        server = await stub.ServerMetadata(pb.ServerMetadataRequest())
    assert "statistics" in server.extensions
    assert after.inference_stats.success.count - before.inference_stats.success.count == 3
    assert after.inference_count - before.inference_count == 18
    assert member.inference_stats.success.count >= 3 and member.execution_count >= 1
    assert member.inference_stats.queue.ns > 0

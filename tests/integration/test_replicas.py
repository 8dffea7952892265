"""A stage with several replicas behind one address: calls spread over them, and survive one stopping."""

from __future__ import annotations

import asyncio

import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.types import TensorSpec
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, wait_serving


class Square(Stage):
    name = "square"
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, 2)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 2)),)

    def infer(self, inputs):
        return {"Y": inputs["X"] ** 2}


ENSEMBLE = """
name: squares
stages:
  s: {{address: "ipv4:{a},{b}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 2]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 2]}}]
steps:
  - {{model_name: square, stage: s, input_map: {{X: X}}, output_map: {{Y: Y}}}}
"""


async def executions(address: str) -> int:
    async with inference_stub(address) as stub:
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="square"))
    return reply.model_stats[0].execution_count


async def test_calls_spread_over_replicas_and_survive_one_stopping(tmp_path):
    x = np.array([[1, 2]], np.float32)
    async with serving_stages([Square()]) as first, serving_stages([Square()]) as second:
        await wait_serving(first.address)
        await wait_serving(second.address)
        (tmp_path / "squares.yaml").write_text(ENSEMBLE.format(a=first.address, b=second.address))
        async with serving_router(load_ensembles([tmp_path])) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                # Concurrent calls: each goes to the replica with the fewest calls out (weighed by latency).
                await asyncio.gather(
                    *(stub.ModelInfer(request_for("squares", X=x), timeout=10) for _ in range(20))
                )
                a, b = await executions(first.address), await executions(second.address)
                assert a + b == 20 and a >= 3 and b >= 3, (a, b)

                await first.stop()
                replies = await asyncio.gather(
                    *(stub.ModelInfer(request_for("squares", X=x), timeout=10) for _ in range(10))
                )
                for reply in replies:
                    np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), x**2)
                assert await executions(second.address) == b + 10


async def test_a_draining_replica_gets_no_new_calls(tmp_path):
    """A replica that reports NOT_SERVING (it is stopping) is skipped before it refuses anything."""
    x = np.array([[3, 4]], np.float32)
    async with serving_stages([Square()], drain_delay=5.0) as first, serving_stages([Square()]) as second:
        await wait_serving(first.address)
        await wait_serving(second.address)
        (tmp_path / "squares.yaml").write_text(ENSEMBLE.format(a=first.address, b=second.address))
        async with serving_router(load_ensembles([tmp_path])) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                for _ in range(4):
                    await stub.ModelInfer(request_for("squares", X=x), timeout=10)
                stopping = asyncio.create_task(first.stop())
                # The health watch reaches the router's channel within milliseconds; allow it a moment.
                await asyncio.sleep(0.5)
                drained = await executions(first.address)
                for _ in range(10):
                    await stub.ModelInfer(request_for("squares", X=x), timeout=10)
                assert await executions(first.address) == drained, "a draining replica still got calls"
                await stopping

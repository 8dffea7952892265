"""A stage whose replicas the router reads from a file of addresses (`file:PATH`, what `pipeline run
--autoscale` rewrites): a replica listed gets calls, one unlisted gets no more, and no call fails meanwhile."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.types import TensorSpec
from pipeline.router.stages.targets import Target, tls_name
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, wait_serving


class Double(Stage):
    name = "double"
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, 2)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 2)),)

    def infer(self, inputs):
        return {"Y": inputs["X"] * 2}


ENSEMBLE = """
name: doubles
stages:
  s: {{address: "file:{path}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 2]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 2]}}]
steps:
  - {{model_name: double, stage: s, input_map: {{X: X}}, output_map: {{Y: Y}}}}
"""


async def _executions(address: str) -> int:
    async with inference_stub(address) as stub:
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="double"))
    return reply.model_stats[0].execution_count


async def _until(check, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"


async def test_replicas_come_and_go_as_the_file_lists_them(tmp_path):
    x = np.ones((1, 2), np.float32)
    listing = tmp_path / "s.addresses"
    async with serving_stages([Double()]) as first, serving_stages([Double()]) as second:
        await wait_serving(first.address)
        await wait_serving(second.address)
        listing.write_text(f"# the stage's replicas\n{first.address}\n")
        (tmp_path / "doubles.yaml").write_text(ENSEMBLE.format(path=listing))
        catalog = load_ensembles([tmp_path / "doubles.yaml"])
        async with (
            serving_router(catalog, options={"resolve_interval": 0.1}) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)

            async def calls(n: int) -> None:
                replies = await asyncio.gather(
                    *(stub.ModelInfer(request_for("doubles", X=x), timeout=10) for _ in range(n))
                )
                assert len(replies) == n  # every call answered: a failure would have raised

            await calls(10)
            assert await _executions(second.address) == 0

            listing.write_text(f"{first.address}\n{second.address}\n")

            async def second_takes_calls() -> bool:
                await calls(10)
                return await _executions(second.address) > 0

            await _until(second_takes_calls)

            listing.write_text(f"{second.address}\n")

            async def first_let_go() -> bool:
                before = await _executions(first.address)
                await calls(10)
                return await _executions(first.address) == before

            await _until(first_let_go)
            before = await _executions(first.address)
            await calls(20)
            assert await _executions(first.address) == before


def test_a_file_target_is_read_not_looked_up():
    target = Target.parse("file:/run/pipeline/model.addresses")
    assert (target.file, target.host, target.fixed) == (True, "/run/pipeline/model.addresses", ())
    assert tls_name("file:/run/pipeline/model.addresses") is None  # each replica's own address is verified

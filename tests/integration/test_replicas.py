"""A stage with several replicas behind one address: calls spread over them, survive one stopping, and each
model goes only to the replicas that serve it."""

from __future__ import annotations

import asyncio

import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.api import Stage
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, wait_serving
from tests.stages import TRITON_ADD_SUB_CONFIG, TRITON_ADD_SUB_MODEL, write_model


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


async def executions(address: str, model: str = "square") -> int:
    async with inference_stub(address) as stub:
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))
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


ADD_SUB_ENSEMBLE = """
name: sums
max_batch_size: 0
stages:
  s: {{address: "ipv4:{a},{b}"}}
inputs: [{{name: A, datatype: FP32, shape: [4]}}, {{name: B, datatype: FP32, shape: [4]}}]
outputs: [{{name: SUM, datatype: FP32, shape: [4]}}]
steps:
  - {{model_name: add_sub, stage: s, input_map: {{INPUT0: A, INPUT1: B}}, output_map: {{OUTPUT0: SUM}}}}
"""


async def test_each_model_goes_only_to_the_replicas_that_serve_it(tmp_path):
    """Two replicas of a stage, only the first serving `add_sub` (explicit model control, the second started
    without it): every request goes to the first, the ensemble stays ready whichever replica the router asks,
    and the metrics say 1 of 2 replicas serve the model; loaded on the second, it takes calls there too, and
    unloaded from the first, the second serves it alone."""
    write_model(tmp_path / "models", "add_sub", TRITON_ADD_SUB_MODEL, TRITON_ADD_SUB_CONFIG)
    repository = ModelRepository(tmp_path / "models")
    explicit = {"model_control_mode": "explicit"}
    a, b = np.arange(4, dtype=np.float32), np.ones(4, np.float32)

    async def sums(stub, n: int) -> None:
        replies = await asyncio.gather(
            *(stub.ModelInfer(request_for("sums", A=a, B=b), timeout=10) for _ in range(n))
        )
        for reply in replies:
            np.testing.assert_array_equal(response_tensors(reply)["SUM"].to_array(), a + b)

    def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    async with (
        serving_stages([], repository=repository, backends=[PythonBackend()], options=explicit) as first,
        serving_stages(
            [], repository=repository, backends=[PythonBackend()], options=explicit, models=[]
        ) as second,
    ):
        await wait_serving(first.address)
        await wait_serving(second.address)
        (tmp_path / "sums.yaml").write_text(ADD_SUB_ENSEMBLE.format(a=first.address, b=second.address))
        metrics = Metrics()
        async with (
            serving_router(load_ensembles([tmp_path / "sums.yaml"]), metrics=metrics) as router,
            inference_stub(router.address) as stub,
            inference_stub(second.address) as direct,
        ):
            await wait_serving(router.address)
            for _ in range(5):
                await sums(stub, 10)
                # Each ModelReady asks both replicas' RepositoryIndex again: the model stays served.
                assert (await stub.ModelReady(pb.ModelReadyRequest(name="sums"))).ready
            index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
            states = {m.name: m.state for m in index.models}
            assert states["sums"] == "READY" and states["add_sub"] == "READY", index
            assert await executions(first.address, "add_sub") == 50
            assert not sample(metrics, "pipeline_stage_retries_total", stage="s")
            assert not sample(metrics, "pipeline_stage_calls_total", stage="s", outcome="UNAVAILABLE")
            assert sample(metrics, "pipeline_stage_replicas_ready", stage="s") == 2
            assert sample(metrics, "pipeline_stage_model_replicas_ready", stage="s", model="add_sub") == 1

            await direct.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="add_sub"))
            # The next ModelReady asks the replicas again, and sees the model served by both.
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="sums"))).ready
            assert sample(metrics, "pipeline_stage_model_replicas_ready", stage="s", model="add_sub") == 2
            await sums(stub, 20)
            assert await executions(second.address, "add_sub") > 0
            assert (
                await executions(first.address, "add_sub") + await executions(second.address, "add_sub") == 70
            )

            # Unloaded from the first, the model is served by the second alone, and the ensemble stays ready.
            async with inference_stub(first.address) as first_stub:
                await first_stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="add_sub"))
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="sums"))).ready
            assert sample(metrics, "pipeline_stage_model_replicas_ready", stage="s", model="add_sub") == 1
            on_second = await executions(second.address, "add_sub")
            await sums(stub, 10)
            assert await executions(second.address, "add_sub") == on_second + 10
            assert not sample(metrics, "pipeline_stage_retries_total", stage="s")

"""Decoupled stage models: a generator `Stage` and a `TritonPythonModel` with a response sender answer one
streamed request with many responses, in order, the last marked final; ModelInfer refuses them; a client
that goes away stops the model within one response and leaves no task behind."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.streams import EMPTY_FINAL_PARAMETER, FINAL_PARAMETER, is_final
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.stream_servicer import STREAM_INFLIGHT
from pipeline.stage.api import Stage
from pipeline.stage.decoupled import BUFFERED
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.stages import write_model


class Count(Stage):
    """Yields N = start, start+1, ... for `count` steps: one response per step."""

    name = "count"
    max_batch_size = 8
    inputs = (TensorSpec("START", "INT64", (-1, 1)), TensorSpec("STEPS", "INT64", (-1, 1)))
    outputs = (TensorSpec("N", "INT64", (-1, 1)),)

    def infer(self, inputs) -> Iterator[dict[str, np.ndarray]]:  # type: ignore[override]
        start, steps = inputs["START"], int(inputs["STEPS"].max())
        for step in range(steps):
            yield {"N": start + step}


class Endless(Stage):
    """Yields forever, each step only once its previous response was taken; `closed` is set when the runtime
    closes the generator."""

    name = "endless"
    inputs = (TensorSpec("X", "INT64", (1,)),)
    outputs = (TensorSpec("Y", "INT64", (1,)),)

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.yielded = 0

    def infer(self, inputs) -> Iterator[dict[str, np.ndarray]]:  # type: ignore[override]
        try:
            while True:
                self.yielded += 1
                yield {"Y": inputs["X"] + self.yielded}
        finally:
            self.closed.set()


class AsyncCount(Stage):
    """An async generator stage: Y = X * k for k = 1, 2, 3."""

    name = "async_count"
    inputs = (TensorSpec("X", "FP32", (2,)),)
    outputs = (TensorSpec("Y", "FP32", (2,)),)

    async def infer(self, inputs) -> AsyncIterator[dict[str, np.ndarray]]:  # type: ignore[override]
        for k in (1, 2, 3):
            await asyncio.sleep(0)
            yield {"Y": inputs["X"] * k}


def pipeline_tasks() -> set[asyncio.Task]:
    """The tasks running this project's code (gRPC's own come and go between calls)."""
    return {
        task
        for task in asyncio.all_tasks()
        if "/pipeline/" in getattr(getattr(task.get_coro(), "cr_code", None), "co_filename", "")
    }


def streamed(model: str, request_id: str, *, empty_final: bool = True, **arrays: np.ndarray):
    request = request_for(model, request_id, **arrays)
    if empty_final:
        request.parameters[EMPTY_FINAL_PARAMETER].bool_param = True
    return request


async def collect(call, ids: set[str]) -> dict[str, list[pb.ModelStreamInferResponse]]:
    """Read a stream until every request of `ids` has had its final response."""
    got: dict[str, list[pb.ModelStreamInferResponse]] = {key: [] for key in ids}
    pending = set(ids)
    async for reply in call:
        got[reply.infer_response.id].append(reply)
        if is_final(reply):
            pending.discard(reply.infer_response.id)
            if not pending:
                break
    return got


async def test_a_generator_stage_streams_each_yield_and_interleaved_requests_keep_their_order() -> None:
    async with serving_stages([Count()]) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        config = await stub.ModelConfig(pb.ModelConfigRequest(name="count"))
        assert config.config.model_transaction_policy.decoupled
        call = stub.ModelStreamInfer(timeout=30)
        requests = {
            "a": streamed("count", "a", START=np.array([[0], [100]]), STEPS=np.array([[5], [5]])),
            "b": streamed("count", "b", START=np.array([[1000]]), STEPS=np.array([[3]])),
        }
        for request in requests.values():
            await call.write(request)
        got = await collect(call, set(requests))
        await call.done_writing()
        a = [response_tensors(r.infer_response)["N"].to_array().ravel().tolist() for r in got["a"][:-1]]
        assert a == [[step, 100 + step] for step in range(5)]
        b = [response_tensors(r.infer_response)["N"].to_array().ravel().tolist() for r in got["b"][:-1]]
        assert b == [[1000], [1001], [1002]]
        for replies in got.values():
            flags = [r.infer_response.parameters[FINAL_PARAMETER].bool_param for r in replies]
            assert flags == [False] * (len(replies) - 1) + [True]
            assert not replies[-1].infer_response.outputs  # the generator's end: the final flag alone


async def test_statistics_count_each_response_by_its_index_as_triton_response_stats() -> None:
    async with serving_stages([Count()]) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        call = stub.ModelStreamInfer(timeout=30)
        await call.write(streamed("count", "a", START=np.array([[0]]), STEPS=np.array([[5]])))
        await call.write(streamed("count", "b", START=np.array([[0]]), STEPS=np.array([[3]])))
        await collect(call, {"a", "b"})
        await call.done_writing()
        (stats,) = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="count"))).model_stats
    # a: responses 0..4 and its final flag alone at 5; b: 0..2, and the final flag at 3.
    by_index = stats.response_stats
    assert sorted(by_index, key=int) == ["0", "1", "2", "3", "4", "5"]
    assert [by_index[str(i)].success.count for i in range(6)] == [2, 2, 2, 1, 1, 0]
    assert [by_index[str(i)].empty_response.count for i in range(6)] == [0, 0, 0, 1, 0, 1]
    assert all(r.fail.count == 0 for r in by_index.values())
    for response in by_index.values():
        assert response.compute_infer.count == response.success.count == response.compute_output.count
        assert response.success.ns >= response.compute_infer.ns


async def test_the_final_flag_alone_is_sent_only_to_a_client_that_asks_for_it() -> None:
    async with serving_stages([Count()]) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        call = stub.ModelStreamInfer(timeout=30)
        quiet = streamed("count", "quiet", empty_final=False, START=np.array([[7]]), STEPS=np.array([[2]]))
        await call.write(quiet)
        await call.write(streamed("count", "asks", START=np.array([[0]]), STEPS=np.array([[1]])))
        await call.done_writing()
        replies = [reply async for reply in call]
        quiet_replies = [r for r in replies if r.infer_response.id == "quiet"]
        assert len(quiet_replies) == 2 and not any(is_final(r) for r in quiet_replies)
        assert [is_final(r) for r in replies if r.infer_response.id == "asks"] == [False, True]


async def test_model_infer_on_a_decoupled_model_is_refused_saying_why() -> None:
    async with serving_stages([Count()]) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        request = request_for("count", START=np.array([[0]]), STEPS=np.array([[2]]))
        err = await rpc_error(stub.ModelInfer(request, timeout=10))
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "doesn't support models with decoupled transaction policy" in (err.details() or "")
        assert "ModelStreamInfer" in (err.details() or "")


async def test_an_async_generator_stage_streams_too() -> None:
    async with serving_stages([AsyncCount()]) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        call = stub.ModelStreamInfer(timeout=30)
        await call.write(streamed("async_count", "x", X=np.array([1.0, 2.0], np.float32)))
        got = await collect(call, {"x"})
        await call.done_writing()
        ys = [response_tensors(r.infer_response)["Y"].to_array().tolist() for r in got["x"][:-1]]
        assert ys == [[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]]


async def test_a_client_that_cancels_stops_the_generator_and_leaves_no_task() -> None:
    endless = Endless()
    async with serving_stages([endless]) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        before = pipeline_tasks()
        for round_ in range(2):  # the one instance is free again for the next request
            endless.closed.clear()
            call = stub.ModelStreamInfer(timeout=30)
            await call.write(streamed("endless", f"r{round_}", X=np.array([5])))
            seen = 0
            async for reply in call:
                assert response_tensors(reply.infer_response)["Y"].to_array().tolist()[0] > 5
                seen += 1
                if seen == 3:
                    break
            call.cancel()
            assert await asyncio.to_thread(endless.closed.wait, 10)
            # Responses wait for their reader: the generator ran at most what a stream and the channel
            # hold past the last response read (the client's channel reads a few ahead of the loop above,
            # more on a busy machine), and stopped at its next yield once the client had gone.
            assert endless.yielded <= 3 + STREAM_INFLIGHT + BUFFERED + 8
            endless.yielded = 0
        for _ in range(200):  # the server's tasks for the stream end once its cancellation reaches them
            if not pipeline_tasks() - before:
                break
            await asyncio.sleep(0.01)
        assert not pipeline_tasks() - before


DECOUPLED_MODEL = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import json
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().ravel()[0])
            sender = request.get_response_sender()
            threading.Thread(target=self.respond, args=(sender, n)).start()
        return None

    def respond(self, sender, n):
        assert self.decoupled
        for i in range(n):
            if sender.is_cancelled():
                break
            if i == 2:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("step 2 is odd", pb_utils.TritonError.INVALID_ARG)))
                continue
            out = pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

DECOUPLED_CONFIG = """
name: "repeat"
backend: "python"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
"""


async def test_a_triton_decoupled_model_sends_from_its_own_thread_after_execute_returned(
    tmp_path: Path,
) -> None:
    write_model(tmp_path, "repeat", DECOUPLED_MODEL, DECOUPLED_CONFIG)
    repository = ModelRepository(tmp_path)
    async with (
        serving_stages([], repository=repository, backends=[PythonBackend()]) as stage,
        inference_stub(stage.address) as stub,
    ):
        await wait_serving(stage.address)
        call = stub.ModelStreamInfer(timeout=30)
        await call.write(streamed("repeat", "t", N=np.array([5], np.int32)))
        got = await collect(call, {"t"})
        await call.done_writing()
        replies = got["t"]
        assert [bool(r.error_message) for r in replies] == [False, False, True, False, False, False]
        assert "step 2 is odd" in replies[2].error_message
        values = [
            response_tensors(r.infer_response)["OUT"].to_array().tolist()
            for r in replies
            if r.infer_response.outputs
        ]
        assert values == [[0], [1], [3], [4]]
        assert is_final(replies[-1]) and not any(is_final(r) for r in replies[:-1])
        err = await rpc_error(stub.ModelInfer(request_for("repeat", N=np.array([1], np.int32)), timeout=10))
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED


SWAPPED_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            sender = request.get_response_sender()
            # The outputs in another order than the config's.
            tensors = [pb_utils.Tensor("SECOND", x * 2), pb_utils.Tensor("FIRST", x + 1)]
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

SWAPPED_CONFIG = """
name: "swapped"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "FIRST" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "SECOND" data_type: TYPE_INT32 dims: [ 1 ] }
]
model_transaction_policy { decoupled: true }
"""


async def test_a_decoupled_response_lists_its_outputs_in_the_order_the_model_set_them(tmp_path: Path) -> None:
    """As Triton answers: the model's order, not the config's (clients that read outputs by position see it);
    outputs a request names are given in the model's order too."""
    write_model(tmp_path, "swapped", SWAPPED_MODEL, SWAPPED_CONFIG)
    async with (
        serving_stages([], repository=ModelRepository(tmp_path), backends=[PythonBackend()]) as stage,
        inference_stub(stage.address) as stub,
    ):
        await wait_serving(stage.address)
        call = stub.ModelStreamInfer(timeout=30)
        await call.write(streamed("swapped", "all", X=np.array([3], np.int32)))
        named = streamed("swapped", "named", X=np.array([3], np.int32))
        named.outputs.add(name="FIRST")
        named.outputs.add(name="SECOND")
        await call.write(named)
        got = await collect(call, {"all", "named"})
        await call.done_writing()
    for key in ("all", "named"):
        reply, final = got[key]
        assert is_final(final) and not final.infer_response.outputs
        assert [output.name for output in reply.infer_response.outputs] == ["SECOND", "FIRST"]
        tensors = response_tensors(reply.infer_response)
        assert (tensors["SECOND"].to_array().tolist(), tensors["FIRST"].to_array().tolist()) == ([6], [4])


pytestmark = pytest.mark.timeout(60)

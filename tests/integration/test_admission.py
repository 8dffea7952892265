"""The router's budget of bytes in flight (`--max-inflight-mb`): a unary request past it is refused at the
door with a retryable code while the router goes on serving, and a stream whose responses are not being
taken is not read further."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import grpc
import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.types import TensorSpec
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, wait_serving
from tests.stages import Scale

#: FP32 columns of a one-row request of some 600 KB.
BIG = 150_000


class Held(Stage):
    """Y = X; a request of more than 1000 columns waits until `release` is set. Counts its requests."""

    name = "held"
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, -1)),)
    outputs = (TensorSpec("Y", "FP32", (-1, -1)),)

    def __init__(self, hold: bool = True) -> None:
        self.hold = hold
        self.entered, self.release = threading.Event(), threading.Event()
        self.requests = 0

    def infer(self, inputs):
        self.requests += 1
        if self.hold and inputs["X"].shape[1] > 1000:
            self.entered.set()
            assert self.release.wait(30)
        return {"Y": inputs["X"]}


def _ensemble(folder, address: str, name: str = "e", model: str = "held", shape: str = "[-1, -1]") -> None:
    (folder / f"{name}.yaml").write_text(
        f"""
name: {name}
stages:
  s: {{address: "{address}"}}
inputs: [{{name: X, datatype: FP32, shape: {shape}}}]
outputs: [{{name: Y, datatype: FP32, shape: {shape}}}]
steps:
  - {{model_name: {model}, stage: s, input_map: {{X: X}}, output_map: {{Y: Y}}}}
"""
    )


def _row(n: int, value: float = 1.0) -> np.ndarray:
    return np.full((1, n), value, np.float32)


async def test_a_request_past_the_budget_is_refused_as_retryable_and_the_router_goes_on(tmp_path) -> None:
    held = Held()
    async with serving_stages([held, Scale()]) as stage:
        await wait_serving(stage.address)
        _ensemble(tmp_path, stage.address)
        _ensemble(tmp_path, stage.address, name="f", model="scale", shape="[-1, 3]")
        async with serving_router(load_ensembles([tmp_path]), options={"max_inflight_mb": 1}) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                first = asyncio.ensure_future(stub.ModelInfer(request_for("e", X=_row(BIG)), timeout=30))
                assert await asyncio.to_thread(held.entered.wait, 30)
                try:
                    await stub.ModelInfer(request_for("e", X=_row(BIG)), timeout=30)
                except grpc.aio.AioRpcError as err:
                    refused = err
                else:
                    raise AssertionError("a second 600 KB request was taken past a 1 MiB budget")
                assert refused.code() == grpc.StatusCode.UNAVAILABLE
                assert "--max-inflight-mb" in (refused.details() or "")
                assert held.requests == 1, "refused before it reached a stage"
                # And over HTTP, in Triton's binary tensor extension.
                raw = _row(BIG).tobytes()
                header = json.dumps(
                    {
                        "inputs": [
                            {
                                "name": "X",
                                "datatype": "FP32",
                                "shape": [1, BIG],
                                "parameters": {"binary_data_size": len(raw)},
                            }
                        ]
                    }
                ).encode()
                async with (
                    aiohttp.ClientSession() as http,
                    http.post(
                        f"http://{router.http_address}/v2/models/e/infer",
                        data=header + raw,
                        headers={"Inference-Header-Content-Length": str(len(header))},
                    ) as answer,
                ):
                    assert answer.status == 503
                    assert "--max-inflight-mb" in (await answer.json())["error"]
                assert held.requests == 1
                # A small request is refused too while the budget holds no room for one like those of late:
                # its size is not known before it is read.
                small = request_for("f", X=np.ones((2, 3), np.float32))
                try:
                    await stub.ModelInfer(small, timeout=30)
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE
                else:
                    raise AssertionError("a request was read while the budget held no room")
                held.release.set()
                assert response_tensors(await first)["Y"].to_array().shape == (1, BIG)
                answer = await stub.ModelInfer(small, timeout=30)
                assert response_tensors(answer)["Y"].to_array().tolist() == [[2.0] * 3] * 2
                # The budget freed with its response: the same request is taken now.
                again = await stub.ModelInfer(request_for("e", X=_row(BIG)), timeout=30)
                assert response_tensors(again)["Y"].to_array().shape == (1, BIG)


async def test_a_request_refused_while_the_budget_is_full_is_refused_before_its_message_is_read(
    tmp_path,
) -> None:
    held = Held()
    async with serving_stages([held]) as stage:
        await wait_serving(stage.address)
        _ensemble(tmp_path, stage.address)
        async with serving_router(
            load_ensembles([tmp_path]), max_message_mb=1, options={"max_inflight_mb": 1}
        ) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                first = asyncio.ensure_future(stub.ModelInfer(request_for("e", X=_row(BIG)), timeout=30))
                assert await asyncio.to_thread(held.entered.wait, 30)
                # Past the router's --max-message-mb: had gRPC received it, the call would fail by its size
                # (RESOURCE_EXHAUSTED), as it does below once the budget is free.
                oversized = request_for("e", X=_row(2 * BIG))
                try:
                    await stub.ModelInfer(oversized, timeout=30)
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
                    assert "--max-inflight-mb" in (err.details() or "")
                else:
                    raise AssertionError("a request was taken past a full budget")
                held.release.set()
                assert response_tensors(await first)["Y"].to_array().shape == (1, BIG)
                try:
                    await stub.ModelInfer(oversized, timeout=30)
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
                else:
                    raise AssertionError("a message past --max-message-mb was taken")
                assert held.requests == 1


async def test_a_stream_whose_responses_are_not_taken_is_not_read_further(tmp_path) -> None:
    stage_model = Held(hold=False)
    sent = 200  # some 120 MB of requests, and as much of responses
    async with serving_stages([stage_model]) as stage:
        await wait_serving(stage.address)
        _ensemble(tmp_path, stage.address)
        async with serving_router(load_ensembles([tmp_path]), options={"max_inflight_mb": 1}) as router:
            await wait_serving(router.address)
            async with grpc.aio.insecure_channel(router.address) as channel:
                call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
                rows = _row(BIG)

                async def write() -> None:
                    for i in range(sent):
                        await call.write(request_for("e", f"r{i}", X=rows))
                    await call.done_writing()

                writer = asyncio.ensure_future(write())
                # Nothing read: the router takes what fits its budget and the transport's windows, then
                # stops reading, and the client's writes wait.
                done, _ = await asyncio.wait({writer}, timeout=3)
                assert not done, "every request was taken although no response was read"
                # What a stream may hold of a 1 MiB budget is a quarter: one request at a time, beside the
                # responses the transport buffers (per-stream request slots alone would let 64 in).
                taken = stage_model.requests
                assert taken < 32, f"the router took {taken} of {sent} requests no one read"
                ids = []
                async for response in call:
                    assert not response.error_message, response.error_message
                    ids.append(response.infer_response.id)
                await writer
                assert sorted(ids) == sorted(f"r{i}" for i in range(sent))
            async with inference_stub(router.address) as stub:
                await stub.ServerLive(pb.ServerLiveRequest())

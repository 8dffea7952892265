"""Faults over real gRPC, in-process: a replica dying mid-call, every stage down, slow stages and deadlines,
in-flight limits, draining on shutdown, and the request limits."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2
from PIL import Image

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import Tensor, infer_response, metadata_response, response_tensors
from pipeline.protocol.errors import ModelNotFound
from pipeline.protocol.model_config import read_config
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.data_plane import DataPlane, RequestContext
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.server import INFERENCE_SERVICE, create_server, set_serving
from pipeline.runtime.servicer import InferenceServicer
from pipeline.stage.api import Stage
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import health_status, inference_stub, request_for, rpc_error, wait_serving
from tests.stages import EXAMPLE_REPOSITORY, example_repository

ANY = (-1, -1)


class Hold(Stage):
    """Echoes X; a request whose first element is negative holds the replica's thread for a while."""

    name = "hold"
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", ANY),)
    outputs = (TensorSpec("Y", "FP32", ANY),)

    def __init__(self) -> None:
        self.started = threading.Event()
        self.calls = 0

    def infer(self, inputs):
        self.calls += 1
        if inputs["X"].flat[0] < 0:
            self.started.set()
            time.sleep(2)
        return {"Y": np.array(inputs["X"])}


class Slow(DataPlane):
    """An async stage `slow` that echoes X after `delay` s, counting calls in progress and their deadlines."""

    SPEC = (TensorSpec("X", "FP32", ANY),)

    def __init__(self, name: str = "slow", delay: float = 0.0) -> None:
        self.name, self.delay = name, delay
        self.running = self.most = self.calls = 0
        self.timeouts: list[float | None] = []

    def ready(self) -> bool:
        return True

    async def model_ready(self, name, version):
        return name == self.name

    async def model_metadata(self, name, version, call):
        if name != self.name:
            raise ModelNotFound(name)
        return metadata_response(self.name, ("1",), "python", self.SPEC, self.SPEC)

    async def model_config(self, name, version, call):
        return mc.ModelConfig(name=self.name, max_batch_size=64)

    async def infer(self, request, call: RequestContext):
        self.calls += 1
        self.timeouts.append(call.timeout)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.running -= 1
        x = Tensor("X", "FP32", tuple(request.inputs[0].shape), request.raw_input_contents[0])
        return infer_response(self.name, "1", request.id, [x])


async def serve_plane(plane: DataPlane) -> tuple[grpc.aio.Server, str]:
    health_servicer = health.aio.HealthServicer()
    server, port = await create_server(
        "127.0.0.1:0", InferenceServicer(InferenceHandler(plane, "spy")), health_servicer
    )
    await server.start()
    await set_serving(health_servicer, True)
    return server, f"127.0.0.1:{port}"


def ensemble(
    folder: Path, address: str, *, model: str = "slow", stage_extra: str = "", steps: str = ""
) -> None:
    steps = steps or f"  - {{model_name: {model}, stage: s, input_map: {{X: X}}, output_map: {{Y: Y}}}}\n"
    (folder / "e.yaml").write_text(
        f"""
name: e
stages:
  s: {{address: "{address}"{stage_extra}}}
inputs: [{{name: X, datatype: FP32, shape: [-1, -1]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, -1]}}]
steps:
{steps}"""
    )


SLOW_STEPS = "  - {model_name: slow, stage: s, input_map: {X: X}, output_map: {X: Y}}\n"


# --- a replica dies ------------------------------------------------------------------------------------


async def test_a_call_in_flight_to_a_replica_that_dies_is_retried_on_another(tmp_path):
    # 300 KB per request: more than gRPC's retry buffer, so gRPC alone would not retry it.
    big = np.full((1, 75_000), 1.0, np.float32)
    held = -big
    first, second = Hold(), Hold()
    async with serving_stages([first], grace=0.0) as a, serving_stages([second]) as b:
        await wait_serving(a.address)
        await wait_serving(b.address)
        ensemble(tmp_path, f"ipv4:{a.address},{b.address}", model="hold")
        async with serving_router(load_ensembles([tmp_path])) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                calls = [
                    asyncio.ensure_future(stub.ModelInfer(request_for("e", X=held), timeout=30))
                    for _ in range(4)
                ]
                while not first.started.is_set():
                    await asyncio.sleep(0.01)
                await a.stop()  # grace 0: the call the replica holds is cut off, unanswered
                replies = await asyncio.gather(*calls)
                for reply in replies:
                    np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), held)
                assert second.calls >= 4  # its own share, and the retried ones
                reply = await stub.ModelInfer(request_for("e", X=big), timeout=30)
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), big)


# --- every stage down ----------------------------------------------------------------------------------


async def test_a_stage_down_fails_fast_the_router_lives_unready_and_recovers(tmp_path):
    x = np.ones((1, 2), np.float32)
    async with serving_stages([Hold()]) as stage:
        await wait_serving(stage.address)
        port = int(stage.address.rsplit(":", 1)[1])
        ensemble(tmp_path, stage.address, model="hold")
        async with (
            serving_router(load_ensembles([tmp_path])) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
            assert (
                await health_status(router.address, INFERENCE_SERVICE)
                == health_pb2.HealthCheckResponse.SERVING
            )
            await stage.stop()

            err = await rpc_error(stub.ModelInfer(request_for("e", X=x), timeout=60))
            # Refused at once, not held until its deadline.
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert "stage 's'" in err.details() and stage.address in err.details()

            # Alive (liveness stays SERVING), not ready (readiness follows the stages).
            assert (await stub.ServerLive(pb.ServerLiveRequest())).live
            assert await health_status(router.address) == health_pb2.HealthCheckResponse.SERVING
            for _ in range(100):
                if await health_status(router.address, INFERENCE_SERVICE) == 2:  # NOT_SERVING
                    break
                await asyncio.sleep(0.05)
            assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
            assert await health_status(router.address, INFERENCE_SERVICE) == 2

            async with serving_stages([Hold()], port=port) as back:
                await wait_serving(back.address)
                for _ in range(100):
                    if (await stub.ServerReady(pb.ServerReadyRequest())).ready:
                        break
                    await asyncio.sleep(0.05)
                assert await health_status(router.address, INFERENCE_SERVICE) == 1  # SERVING
                reply = await stub.ModelInfer(request_for("e", X=x), timeout=30)
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), x)


# --- slow stages, deadlines, limits in flight ----------------------------------------------------------


async def test_a_request_past_its_deadline_goes_no_further(tmp_path):
    slow, after = Slow(delay=1.0), Slow("after")
    server_a, slow_address = await serve_plane(slow)
    server_b, after_address = await serve_plane(after)
    try:
        (tmp_path / "e.yaml").write_text(
            f"""
name: e
stages:
  a: {{address: "{slow_address}"}}
  b: {{address: "{after_address}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, -1]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, -1]}}]
steps:
  - {{model_name: slow, stage: a, input_map: {{X: X}}, output_map: {{X: mid}}}}
  - {{model_name: after, stage: b, input_map: {{X: mid}}, output_map: {{X: Y}}}}
"""
        )
        async with (
            serving_router(load_ensembles([tmp_path])) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            err = await rpc_error(
                stub.ModelInfer(request_for("e", X=np.ones((1, 2), np.float32)), timeout=0.3)
            )
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert slow.timeouts[-1] is not None and slow.timeouts[-1] <= 0.35  # the deadline went along
            await asyncio.sleep(1.2)  # the slow stage has answered by now, too late
            assert after.calls == 0
    finally:
        await server_a.stop(0)
        await server_b.stop(0)


async def test_a_batched_stage_call_carries_its_members_deadline(tmp_path):
    slow = Slow()
    server, address = await serve_plane(slow)
    try:
        ensemble(tmp_path, address, stage_extra=", dynamic_batching: {max_batch_size: 8}", steps=SLOW_STEPS)
        async with (
            serving_router(load_ensembles([tmp_path])) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            await stub.ModelInfer(request_for("e", X=np.ones((1, 2), np.float32)), timeout=5)
            assert slow.timeouts[-1] is not None and 0 < slow.timeouts[-1] <= 5.1  # gRPC rounds up
    finally:
        await server.stop(0)


async def test_max_inflight_requests_bounds_the_calls_of_an_unbatched_stage(tmp_path):
    slow = Slow(delay=0.2)
    server, address = await serve_plane(slow)
    try:
        ensemble(tmp_path, address, stage_extra=", max_inflight_requests: 2", steps=SLOW_STEPS)
        async with (
            serving_router(load_ensembles([tmp_path])) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            x = np.ones((1, 2), np.float32)
            await asyncio.gather(*(stub.ModelInfer(request_for("e", X=x), timeout=30) for _ in range(8)))
            assert slow.calls == 8 and slow.most == 2
    finally:
        await server.stop(0)


async def test_the_router_sheds_load_beyond_its_in_flight_limit(tmp_path):
    slow = Slow(delay=0.5)
    server, address = await serve_plane(slow)
    try:
        ensemble(tmp_path, address, steps=SLOW_STEPS)
        catalog = load_ensembles([tmp_path])
        async with (
            serving_router(catalog, options={"max_inflight_requests": 2}) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            x = np.ones((1, 2), np.float32)
            results = await asyncio.gather(
                *(stub.ModelInfer(request_for("e", X=x), timeout=30) for _ in range(6)),
                return_exceptions=True,
            )
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert len(results) - len(refused) >= 2 and refused
            for err in refused:
                assert err.code() == grpc.StatusCode.UNAVAILABLE and "saturated" in err.details()
            assert slow.most <= 2
            await stub.ModelInfer(request_for("e", X=x), timeout=30)  # and it serves on
    finally:
        await server.stop(0)


async def test_stopping_the_router_completes_the_requests_it_accepted(tmp_path):
    slow = Slow(delay=1.0)
    server, address = await serve_plane(slow)
    try:
        ensemble(tmp_path, address, steps=SLOW_STEPS)
        async with serving_router(load_ensembles([tmp_path]), grace=10) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                x = np.ones((1, 2), np.float32)
                calls = [
                    asyncio.ensure_future(stub.ModelInfer(request_for("e", X=x), timeout=30))
                    for _ in range(5)
                ]
                while slow.running < 5:
                    await asyncio.sleep(0.01)
                await router.stop()  # what SIGTERM does
                for reply in await asyncio.gather(*calls):
                    np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), x)
    finally:
        await server.stop(0)


# --- request limits ------------------------------------------------------------------------------------


async def test_max_batch_items_refuses_a_request_carrying_more(tmp_path):
    slow = Slow()
    server, address = await serve_plane(slow)
    try:
        ensemble(tmp_path, address, steps=SLOW_STEPS)
        catalog = load_ensembles([tmp_path])
        async with (
            serving_router(catalog, options={"max_batch_items": 4}) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            await stub.ModelInfer(request_for("e", X=np.ones((4, 2), np.float32)), timeout=10)
            err = await rpc_error(
                stub.ModelInfer(request_for("e", X=np.ones((5, 2), np.float32)), timeout=10)
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_batch_items" in err.details() and "'X'" in err.details()
            assert slow.calls == 1
    finally:
        await server.stop(0)


def test_the_preprocess_limits_are_config_parameters() -> None:
    for name, key in (("digits_preprocess", "max_image_pixels"), ("embeddings_tokenize", "max_text_bytes")):
        config = read_config(EXAMPLE_REPOSITORY / name / "config.pbtxt")
        assert int(config.parameters[key].string_value) > 0


async def test_limits_refuse_bombs_long_text_and_huge_messages(tmp_path):
    repository = example_repository(
        tmp_path / "repository",
        ["digits_preprocess", "embeddings_tokenize"],
        {"digits_preprocess": {"max_image_pixels": 100 * 100}, "embeddings_tokenize": {"max_text_bytes": 32}},
    )
    async with serving_stages([], repository=ModelRepository(repository), backends=[PythonBackend()]) as pre:
        await wait_serving(pre.address, timeout=60)
        (tmp_path / "e.yaml").write_text(
            f"""
name: e
stages:
  p: {{address: "{pre.address}"}}
inputs: [{{name: IMAGE, datatype: BYTES, shape: [-1, 1]}}, {{name: TEXT, datatype: BYTES, shape: [-1, 1]}}]
outputs: [{{name: PIXELS, datatype: FP32, shape: [-1, 1, 8, 8]}}, {{name: IDS, datatype: INT64, shape: [-1, -1]}}]
steps:
  - {{model_name: digits_preprocess, stage: p, input_map: {{IMAGE: IMAGE}}, output_map: {{PIXELS: PIXELS}}}}
  - {{model_name: embeddings_tokenize, stage: p, input_map: {{TEXT: TEXT}},
     output_map: {{INPUT_IDS: IDS, ATTENTION_MASK: mask}}}}
"""
        )
        async with (
            serving_router(load_ensembles([tmp_path]), max_message_mb=1) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)

            def request(image: bytes, text: bytes) -> pb.ModelInferRequest:
                images, texts = np.empty((1, 1), object), np.empty((1, 1), object)
                images[0, 0], texts[0, 0] = image, text
                return request_for("e", IMAGE=images, TEXT=texts)

            png = io.BytesIO()
            Image.new("L", (8, 8), 255).save(png, format="PNG")
            await stub.ModelInfer(request(png.getvalue(), b"short"), timeout=30)

            bomb = io.BytesIO()
            Image.new("L", (4000, 4000), 255).save(bomb, format="PNG")  # 16 Mpixel in a few KB
            err = await rpc_error(stub.ModelInfer(request(bomb.getvalue(), b"short"), timeout=30))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "IMAGE[0]" in err.details()

            err = await rpc_error(stub.ModelInfer(request(png.getvalue(), b"x" * 33), timeout=30))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "TEXT[0]" in err.details()

            err = await rpc_error(stub.ModelInfer(request(png.getvalue(), b"x" * 2_000_000), timeout=30))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await stub.ModelInfer(request(png.getvalue(), b"short"), timeout=30)

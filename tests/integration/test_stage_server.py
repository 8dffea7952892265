"""A stage service over real gRPC on 127.0.0.1: protocol, validation, errors, health, reflection, shutdown."""

from __future__ import annotations

import asyncio
import threading

import grpc
import ml_dtypes
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.datatypes import DATATYPES
from pipeline.protocol.errors import InvalidInput
from pipeline.protocol.types import TensorSpec
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_stages
from tests.conftest import health_status, inference_stub, request_for, rpc_error, wait_serving


class Identity(Stage):
    """Returns its input: a round trip of one datatype through the server."""

    max_batch_size = 8

    def __init__(self, datatype: str) -> None:
        self.name = f"identity_{datatype.lower()}"
        self.inputs = (TensorSpec("IN", datatype, (-1, -1)),)
        self.outputs = (TensorSpec("OUT", datatype, (-1, -1)),)

    def infer(self, inputs):
        return {"OUT": inputs["IN"]}


class Add(Stage):
    name = "add"
    max_batch_size = 4
    inputs = (TensorSpec("A", "FP32", (-1, 3)), TensorSpec("B", "FP32", (-1, 3)))
    outputs = (TensorSpec("SUM", "FP32", (-1, 3)), TensorSpec("DIFF", "FP32", (-1, 3)))

    def infer(self, inputs):
        return {"SUM": inputs["A"] + inputs["B"], "DIFF": inputs["A"] - inputs["B"]}


class Picky(Stage):
    """Refuses items containing a negative value, naming the index; crashes on 13."""

    name = "picky"
    max_batch_size = 8
    inputs = (TensorSpec("X", "INT32", (-1, 1)),)
    outputs = (TensorSpec("Y", "INT32", (-1, 1)),)

    def infer(self, inputs):
        x = inputs["X"]
        if (x == 13).any():
            raise RuntimeError("secret internal detail")
        bad = np.flatnonzero(x[:, 0] < 0)
        if bad.size:
            raise InvalidInput(f"X[{bad[0]}]: negative values are not allowed")
        return {"Y": x * 2}


class Gated(Stage):
    """A stage whose load and inference wait on events the test controls."""

    name = "gated"
    max_batch_size = 1
    inputs = (TensorSpec("X", "FP32", (-1, 1)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 1)),)

    def __init__(self) -> None:
        self.may_load = threading.Event()
        self.entered = threading.Event()
        self.may_finish = threading.Event()

    def load(self):
        assert self.may_load.wait(10)

    def infer(self, inputs):
        self.entered.set()
        assert self.may_finish.wait(10)
        return {"Y": inputs["X"] + 1}


def random_array(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if datatype == "BYTES":
        items = [rng.bytes(int(n)) for n in rng.integers(0, 20, size=int(np.prod(shape)))]
        array = np.empty(len(items), dtype=object)
        array[:] = items
        return array.reshape(shape)
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(bool)
    dtype = DATATYPES[datatype]
    if datatype == "BF16":
        return rng.normal(size=shape).astype(ml_dtypes.bfloat16)
    if dtype.kind == "f":
        return rng.normal(size=shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


STAGES = [Identity(dt) for dt in DATATYPES] + [Add(), Picky()]


@pytest.fixture(scope="module")
async def stage_address():
    async with serving_stages(STAGES, max_message_mb=1) as running:
        await wait_serving(running.address)
        yield running.address


async def test_every_datatype_round_trips_as_raw_output(stage_address):
    rng = np.random.default_rng(0)
    async with inference_stub(stage_address) as stub:
        for datatype in DATATYPES:
            array = random_array(datatype, (3, 5), rng)
            response = await stub.ModelInfer(request_for(f"identity_{datatype.lower()}", IN=array))
            assert len(response.raw_output_contents) == 1, "outputs must come back as raw_output_contents"
            assert response.outputs[0].datatype == datatype
            assert list(response.outputs[0].shape) == [3, 5]
            back = response_tensors(response)["OUT"].to_array()
            if datatype == "BYTES":
                assert back.tolist() == array.tolist()
            else:
                np.testing.assert_array_equal(back.view(np.uint8), array.view(np.uint8))


async def test_typed_contents_are_accepted(stage_address):
    request = pb.ModelInferRequest(model_name="identity_int32")
    tensor = request.inputs.add(name="IN", datatype="INT32", shape=[2, 2])
    tensor.contents.int_contents.extend([1, -2, 3, 4])
    async with inference_stub(stage_address) as stub:
        response = await stub.ModelInfer(request)
    np.testing.assert_array_equal(response_tensors(response)["OUT"].to_array(), [[1, -2], [3, 4]])


async def test_metadata_and_config(stage_address):
    async with inference_stub(stage_address) as stub:
        meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="add"))
        assert meta.name == "add" and list(meta.versions) == ["1"]
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
            ("A", "FP32", [-1, 3]),
            ("B", "FP32", [-1, 3]),
        ]
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="add"))).config
        assert config.max_batch_size == 4
        assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
            ("A", mc.TYPE_FP32, [3]),
            ("B", mc.TYPE_FP32, [3]),
        ]
        server = await stub.ServerMetadata(pb.ServerMetadataRequest())
        assert "model_configuration" in server.extensions
        assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
        assert (await stub.ModelReady(pb.ModelReadyRequest(name="add"))).ready
        assert not (await stub.ModelReady(pb.ModelReadyRequest(name="nope"))).ready


async def test_requested_outputs_only(stage_address):
    request = request_for("add", A=np.ones((1, 3), np.float32), B=np.ones((1, 3), np.float32))
    request.outputs.add(name="DIFF")
    async with inference_stub(stage_address) as stub:
        response = await stub.ModelInfer(request)
    assert [o.name for o in response.outputs] == ["DIFF"]


GOOD = {"A": np.ones((2, 3), np.float32), "B": np.ones((2, 3), np.float32)}


@pytest.mark.parametrize(
    ("request_", "code", "words"),
    [
        (request_for("nope", **GOOD), grpc.StatusCode.NOT_FOUND, ["nope"]),
        (request_for("add", A=GOOD["A"], C=GOOD["B"]), grpc.StatusCode.INVALID_ARGUMENT, ["'C'", "A, B"]),
        (request_for("add", A=GOOD["A"]), grpc.StatusCode.INVALID_ARGUMENT, ["B"]),
        (
            request_for("add", A=GOOD["A"], B=GOOD["B"].astype(np.float64)),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["'B'", "FP32", "FP64"],
        ),
        (
            request_for("add", A=np.ones((2, 4), np.float32), B=GOOD["B"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["'A'", "[-1, 3]", "[2, 4]"],
        ),
        (
            request_for("add", A=np.ones((5, 3), np.float32), B=np.ones((5, 3), np.float32)),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["batch size 5", "max_batch_size"],
        ),
        (
            request_for("add", A=np.ones((1, 3), np.float32), B=GOOD["B"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["batch size", "'A' has 1", "'B' has 2"],
        ),
        (request_for("picky", X=np.array([[1], [-1]], np.int32)), grpc.StatusCode.INVALID_ARGUMENT, ["X[1]"]),
    ],
    ids=[
        "unknown-model",
        "unknown-input",
        "missing-input",
        "wrong-datatype",
        "wrong-shape",
        "batch-too-big",
        "batch-mismatch",
        "item-error",
    ],
)
async def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(
    stage_address, request_, code, words
):
    async with inference_stub(stage_address) as stub:
        err = await rpc_error(stub.ModelInfer(request_))
        assert err.code() == code
        for word in words:
            assert word in err.details()
        response = await stub.ModelInfer(request_for("add", **GOOD))
        np.testing.assert_array_equal(response_tensors(response)["SUM"].to_array(), GOOD["A"] * 2)


async def test_wrong_byte_counts_are_refused(stage_address):
    async with inference_stub(stage_address) as stub:
        request = request_for("add", **GOOD)
        request.raw_input_contents[1] = request.raw_input_contents[1][:-4]
        err = await rpc_error(stub.ModelInfer(request))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'B'" in err.details() and "24 bytes" in err.details() and "got 20" in err.details()

        lying = pb.ModelInferRequest(model_name="identity_bytes")
        lying.inputs.add(name="IN", datatype="BYTES", shape=[1, 2])
        lying.raw_input_contents.append(b"\x02\x00\x00\x00ab\xff\x00\x00\x00xy")
        err = await rpc_error(stub.ModelInfer(lying))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'IN'" in err.details() and "element 1" in err.details()

        fp16 = pb.ModelInferRequest(model_name="identity_fp16")
        fp16.inputs.add(name="IN", datatype="FP16", shape=[1, 1]).contents.fp32_contents.append(1.0)
        err = await rpc_error(stub.ModelInfer(fp16))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "raw_input_contents" in err.details()


async def test_internal_errors_hide_details(stage_address):
    async with inference_stub(stage_address) as stub:
        err = await rpc_error(stub.ModelInfer(request_for("picky", X=np.array([[13]], np.int32))))
        assert err.code() == grpc.StatusCode.INTERNAL
        assert "secret" not in err.details() and "incident" in err.details()


async def test_oversize_message_is_resource_exhausted(stage_address):
    big = np.zeros((1, 2 * 1024 * 1024), np.uint8)  # 2 MiB against the server's 1 MiB limit
    async with inference_stub(stage_address) as stub:
        err = await rpc_error(stub.ModelInfer(request_for("identity_uint8", IN=big)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await stub.ServerLive(pb.ServerLiveRequest())).live


async def test_stream_infer_answers_each_request(stage_address):
    requests = [request_for("add", **GOOD), request_for("nope", **GOOD), request_for("add", **GOOD)]

    async def produce():
        for request in requests:
            yield request

    async with inference_stub(stage_address) as stub:
        replies = [reply async for reply in stub.ModelStreamInfer(produce())]
    assert len(replies) == 3
    assert sum(1 for r in replies if r.error_message) == 1
    assert any("nope" in r.error_message for r in replies)


async def test_reflection_lists_the_services(stage_address):
    async with grpc.aio.insecure_channel(stage_address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def ask():
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            yield reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="inference.GRPCInferenceService"
            )

        replies = [reply async for reply in stub.ServerReflectionInfo(ask())]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names
    assert replies[1].file_descriptor_response.file_descriptor_proto


async def test_health_turns_serving_only_after_load_and_shutdown_drains():
    gated = Gated()
    async with serving_stages([gated]) as running:
        await asyncio.sleep(0.2)
        assert await health_status(running.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        async with inference_stub(running.address) as stub:
            assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
            err = await rpc_error(stub.ModelInfer(request_for("gated", X=np.ones((1, 1), np.float32))))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            gated.may_load.set()
            await wait_serving(running.address)

            in_flight = asyncio.ensure_future(
                stub.ModelInfer(request_for("gated", X=np.ones((1, 1), np.float32)))
            )
            assert await asyncio.to_thread(gated.entered.wait, 10)
            stopping = asyncio.create_task(running.stop())  # what SIGTERM does
            await asyncio.sleep(0.2)
            assert not stopping.done(), "shutdown must wait for the request in flight"
            gated.may_finish.set()
            response = await in_flight
            np.testing.assert_array_equal(response_tensors(response)["Y"].to_array(), [[2.0]])
            await stopping


async def test_a_reflection_client_resolves_the_whole_protocol(stage_address):
    """What grpcurl does: build descriptors from reflection alone (dependencies resolved by file name)."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    def resolve() -> tuple[str, list[str]]:
        with grpc.insecure_channel(stage_address) as channel:
            pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
            service = pool.FindServiceByName("inference.GRPCInferenceService")
            infer = service.methods_by_name["ModelInfer"]
            config = pool.FindMessageTypeByName("inference.ModelConfigResponse")
            return infer.input_type.full_name, [
                f.name for f in config.fields_by_name["config"].message_type.fields
            ]

    request_type, config_fields = await asyncio.to_thread(resolve)
    assert request_type == "inference.ModelInferRequest"
    assert {"name", "platform", "max_batch_size", "input", "output", "ensemble_scheduling"} <= set(
        config_fields
    )


class WhereAmI(Stage):
    """Records the thread its `infer` runs on."""

    max_batch_size = 1
    inputs = (TensorSpec("X", "FP32", (-1, 1)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 1)),)

    def __init__(self, name: str, inline: bool) -> None:
        self.name = name
        self.inline = inline
        self.threads: list[str] = []

    def infer(self, inputs):
        self.threads.append(threading.current_thread().name)
        return {"Y": inputs["X"]}


async def test_inline_stages_run_on_the_event_loop_and_others_on_their_own_thread():
    inline, threaded = WhereAmI("inline", True), WhereAmI("threaded", False)
    async with serving_stages([inline, threaded]) as running:
        await wait_serving(running.address)
        async with inference_stub(running.address) as stub:
            for name in ("inline", "threaded"):
                await stub.ModelInfer(request_for(name, X=np.ones((1, 1), np.float32)))
    assert inline.threads == [threading.current_thread().name]  # the loop's thread: this test's
    assert threaded.threads[0].startswith("stage-threaded")

"""Triton's system shared-memory extension as a client uses it: a region registered with a server, inputs
read from it and outputs written into it, and requests that name a region wrongly refused."""

from __future__ import annotations

import mmap
import os
import secrets

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.tools.testing import serving_stages
from tests.conftest import inference_stub, rpc_error, wait_serving
from tests.stages import Scale


@pytest.fixture
def region():
    """A 64 KiB POSIX shared-memory region of this test's own: its key and its mapping."""
    key = f"/pipeline-test-{secrets.token_hex(4)}"
    path = f"/dev/shm{key}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 16)
    memory = mmap.mmap(fd, 1 << 16)
    os.close(fd)
    yield key, memory
    memory.close()
    os.unlink(path)


def _request(x: np.ndarray, *, input_offset: int, output_offset: int | None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="scale", id="shm-1")
    tensor = request.inputs.add(name="X", datatype="FP32", shape=list(x.shape))
    tensor.parameters["shared_memory_region"].string_param = "mine"
    tensor.parameters["shared_memory_byte_size"].int64_param = x.nbytes
    tensor.parameters["shared_memory_offset"].int64_param = input_offset
    output = request.outputs.add(name="Y")
    if output_offset is not None:
        output.parameters["shared_memory_region"].string_param = "mine"
        output.parameters["shared_memory_byte_size"].int64_param = x.nbytes
        output.parameters["shared_memory_offset"].int64_param = output_offset
    return request


async def test_inputs_and_outputs_in_a_registered_region(region) -> None:
    key, memory = region
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    memory[1024 : 1024 + x.nbytes] = x.tobytes()
    async with serving_stages([Scale()]) as stage:
        await wait_serving(stage.address)
        async with inference_stub(stage.address) as stub:
            meta = await stub.ServerMetadata(pb.ServerMetadataRequest())
            assert "system_shared_memory" in meta.extensions
            await stub.SystemSharedMemoryRegister(
                pb.SystemSharedMemoryRegisterRequest(name="mine", key=key, byte_size=1 << 16)
            )
            status = await stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(name="mine"))
            assert status.regions["mine"].key == key and status.regions["mine"].byte_size == 1 << 16

            # The output in the region: the response says where, and carries no bytes of it.
            reply = await stub.ModelInfer(_request(x, input_offset=1024, output_offset=8192))
            (output,) = reply.outputs
            assert output.parameters["shared_memory_region"].string_param == "mine"
            assert output.parameters["shared_memory_byte_size"].int64_param == x.nbytes
            assert not any(reply.raw_output_contents)
            y = np.frombuffer(memory[8192 : 8192 + x.nbytes], np.float32).reshape(4, 3)
            np.testing.assert_array_equal(y, 2 * x)

            # The input in the region, the output in the message.
            reply = await stub.ModelInfer(_request(x, input_offset=1024, output_offset=None))
            y = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(4, 3)
            np.testing.assert_array_equal(y, 2 * x)

            await stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name="mine"))
            err = await rpc_error(stub.ModelInfer(_request(x, input_offset=1024, output_offset=None)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown shared memory region 'mine'" in (err.details() or "")


async def test_a_region_named_wrongly_is_refused_and_the_server_goes_on(region) -> None:
    key, _ = region
    x = np.ones((2, 3), np.float32)
    async with serving_stages([Scale()]) as stage:
        await wait_serving(stage.address)
        async with inference_stub(stage.address) as stub:
            for bad_key, why in (
                ("/no-such-region-here", "cannot open shared memory key"),
                ("../etc/passwd", "not a POSIX"),
            ):
                err = await rpc_error(
                    stub.SystemSharedMemoryRegister(
                        pb.SystemSharedMemoryRegisterRequest(name="bad", key=bad_key, byte_size=64)
                    )
                )
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and why in (err.details() or "")
            err = await rpc_error(
                stub.SystemSharedMemoryRegister(
                    pb.SystemSharedMemoryRegisterRequest(name="big", key=key, byte_size=1 << 20)
                )
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "do not fit" in (err.details() or "")
            await stub.SystemSharedMemoryRegister(
                pb.SystemSharedMemoryRegisterRequest(name="mine", key=key, byte_size=1 << 16)
            )
            # Bytes that fall outside the region.
            err = await rpc_error(
                stub.ModelInfer(_request(x, input_offset=(1 << 16) - 8, output_offset=None))
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "do not fit" in (err.details() or "")
            # An output larger than the room given for it.
            small = _request(x, input_offset=0, output_offset=0)
            small.outputs[0].parameters["shared_memory_byte_size"].int64_param = 4
            err = await rpc_error(stub.ModelInfer(small))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs 24 bytes" in (
                err.details() or ""
            )
            reply = await stub.ModelInfer(_request(x, input_offset=0, output_offset=4096))
            assert reply.outputs[0].parameters["shared_memory_byte_size"].int64_param == x.nbytes

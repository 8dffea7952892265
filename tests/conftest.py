"""Shared test helpers: async OIP clients for in-process servers, and waiting for health."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import Tensor
from pipeline.runtime.server import server_options


@contextlib.asynccontextmanager
async def inference_stub(
    address: str, *, max_message_bytes: int = 256 * 1024 * 1024
) -> AsyncIterator[pb_grpc.GRPCInferenceServiceStub]:
    """An aio stub for `inference.GRPCInferenceService` at `address`."""
    async with grpc.aio.insecure_channel(address, options=server_options(max_message_bytes)) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


async def health_status(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
        return reply.status


async def wait_serving(address: str, timeout: float = 30.0) -> None:
    """Wait until the server at `address` reports SERVING."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):
            if await health_status(address) == health_pb2.HealthCheckResponse.SERVING:
                return
        if loop.time() > deadline:
            raise TimeoutError(f"{address} did not become SERVING within {timeout}s")
        await asyncio.sleep(0.05)


async def watch_health(address: str, service: str, status: int, timeout: float = 30.0) -> None:
    """Wait until the health service at `address` reports `status` for `service`, as its `Watch` stream
    tells each change (no polling)."""
    async with grpc.aio.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        async for reply in watch:
            if reply.status == status:
                watch.cancel()
                return
    raise AssertionError(f"{address}: the health watch of '{service}' ended before {status}")


async def rpc_error(call) -> grpc.aio.AioRpcError:
    """Await a call that must fail; return its error."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def request_for(model: str, request_id: str = "req-1", **arrays: np.ndarray) -> pb.ModelInferRequest:
    """A ModelInferRequest carrying `arrays` as raw inputs named by their keywords."""
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    for name, array in arrays.items():
        tensor = Tensor.from_array(name, array)
        request.inputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
        request.raw_input_contents.append(tensor.raw)
    return request

"""The gRPC door every server shares: it hands each RPC to the server's `InferenceHandler`
(`pipeline.runtime.handler`: inference, its budget, spans, metrics and shared memory) or the handler's
`DataPlane` (a stage service's or the router's, `pipeline.runtime.data_plane`), and maps the `PipelineError`s
they raise to gRPC status codes, in one place (`pipeline.runtime.error_status`); a stream's requests are read
and run by `pipeline.runtime.stream_servicer`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.errors import InvalidInput, PipelineError
from pipeline.runtime.admission import cost_of
from pipeline.runtime.call_abort import abort
from pipeline.runtime.data_plane import RequestContext
from pipeline.runtime.error_status import internal_error, status_details
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.stream_servicer import StreamRequests

T = TypeVar("T")
R = TypeVar("R")


async def _guarded(
    context: grpc.aio.ServicerContext, work: Awaitable[T], reply: Callable[[T], R] | None = None
) -> R | T | None:
    """The response of a unary RPC: `work`'s result (made one by `reply`). A `PipelineError` ends the call
    with its status, anything else with INTERNAL, and None is returned for the handler to return (gRPC
    discards it); the call is aborted outside the `except` block, so that nothing keeps the request
    (`pipeline.runtime.call_abort`)."""
    try:
        done = await work
        return done if reply is None else reply(done)
    except grpc.aio.AbortError:
        raise
    except PipelineError as err:
        code, message, trailing = err.code, err.message, status_details(err)
    except Exception:
        code, message, trailing = grpc.StatusCode.INTERNAL, internal_error(), ()
    await abort(context, code, message, trailing)
    return None


async def _now(function: Callable[..., T], *args: object) -> T:
    """A plain call, as an awaitable for `_guarded`."""
    return function(*args)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """`inference.GRPCInferenceService` over an `InferenceHandler`: a thin adapter from gRPC's calls."""

    def __init__(self, handler: InferenceHandler) -> None:
        self.handler = handler
        self.plane = handler.plane

    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext):
        return pb.ServerReadyResponse(ready=self.plane.ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext):
        ready = self.plane.model_ready(request.name, request.version)
        return await _guarded(context, ready, lambda ready: pb.ModelReadyResponse(ready=ready))

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext):
        return self.handler.server_metadata()

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext):
        call = RequestContext.of(context)
        return await _guarded(context, self.plane.model_metadata(request.name, request.version, call))

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext):
        call = RequestContext.of(context)
        config = self.plane.model_config(request.name, request.version, call)
        return await _guarded(context, config, lambda config: pb.ModelConfigResponse(config=config))

    async def ModelInferWithinBudget(self, requests: object, context: grpc.aio.ServicerContext):
        """`ModelInfer` as it is served (`pipeline.runtime.server`): a handler that reads its one request
        itself, once the budget of bytes in flight has room for it, so that a request refused while the
        budget is full is refused before gRPC received its message."""
        return await _guarded(context, self._read_admitted(context))

    async def _read_admitted(self, context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        handler = self.handler
        budget = handler.budget
        reserved = await budget.reserve_read()
        size = None
        try:
            data = await context.read()  # the message's bytes: this handler has no deserializer
            if not isinstance(data, bytes):
                raise InvalidInput("ModelInfer: the call ended before its request came")
            size = len(data)
        finally:
            budget.read(reserved, size)
        budget.admit(cost := cost_of(size))
        try:
            request = pb.ModelInferRequest.FromString(data)
            del data
            return await handler.infer(request, RequestContext.of(context))
        finally:
            budget.release(cost)

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext):
        return await _guarded(context, self.plane.statistics(request.name, request.version))

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext):
        return await _guarded(context, self.plane.repository_index(request.ready))

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ):
        params = {
            k: getattr(v, v.WhichOneof("parameter_choice") or "string_param")
            for k, v in request.parameters.items()
        }
        load = self.plane.repository_load(
            request.model_name, params, RequestContext.of(context, credentials=True)
        )
        return await _guarded(context, load, lambda _: pb.RepositoryModelLoadResponse())

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ):
        params = {
            k: getattr(v, v.WhichOneof("parameter_choice") or "string_param")
            for k, v in request.parameters.items()
        }
        unload = self.plane.repository_unload(
            request.model_name, params, RequestContext.of(context, credentials=True)
        )
        return await _guarded(context, unload, lambda _: pb.RepositoryModelUnloadResponse())

    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: grpc.aio.ServicerContext
    ):
        return await _guarded(context, _now(self.handler.shared_memory.status, request.name))

    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: grpc.aio.ServicerContext
    ):
        register = self.handler.shared_memory.register
        registered = _now(register, request.name, request.key, request.offset, request.byte_size)
        return await _guarded(context, registered, lambda _: pb.SystemSharedMemoryRegisterResponse())

    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: grpc.aio.ServicerContext
    ):
        unregistered = _now(self.handler.shared_memory.unregister, request.name)
        return await _guarded(context, unregistered, lambda _: pb.SystemSharedMemoryUnregisterResponse())

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests on a stream run concurrently; each response (or error, with its id and status) is sent
        as it completes, and a decoupled model's many responses to a request in the order it makes them.
        A stream holds at most `CONNECTION_INFLIGHT` requests, `STREAM_INFLIGHT` decoupled responses past
        each request's first, and its share of the budget of bytes in flight (`pipeline.runtime.admission`),
        answered or not: a client that stops reading its responses is not read from, and a decoupled model
        not run on, either (backpressure). The requests of one model hold at most their share of it
        (`ModelShares`): past it they are refused at once, and the others still run. `StreamRequests`
        reads and runs the requests; this writes their responses."""
        stream = StreamRequests(self.handler, RequestContext.of(context))
        done, hold = stream.done, stream.hold
        reader = asyncio.create_task(stream.read(request_iterator))
        try:
            while (item := await done.get()) is not None:
                response, size, slot = item
                yield response
                hold.free(size)
                slot.release()
        finally:
            reader.cancel()
            stream.close()

"""The protocol servicer every server shares: it hands each RPC to a `DataPlane` (a stage service's or the
router's, `pipeline.runtime.data_plane`) and maps the `PipelineError`s the plane raises to gRPC status codes,
in one place (`pipeline.runtime.error_status`); a stream's requests are read and run by
`pipeline.runtime.stream_servicer`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

import pipeline
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.errors import InvalidInput, ModelNotFound, PipelineError
from pipeline.protocol.frames import extension as frames_extension
from pipeline.protocol.streams import (
    error_response,
    hop_context,
    is_final,
    set_final,
    status_of,
    wants_empty_final,
)
from pipeline.runtime.admission import ByteBudget, cost_of
from pipeline.runtime.call_abort import abort
from pipeline.runtime.data_plane import DataPlane, RequestContext
from pipeline.runtime.error_status import internal_error, outcome_of, rpc_status_of, status_details
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.shared_memory import SharedMemoryRegistry
from pipeline.runtime.shutdown import HeldRequests
from pipeline.runtime.stream_servicer import StreamRequests
from pipeline.runtime.telemetry import (
    MODEL,
    NO_SPAN,
    REQUEST_ID,
    RESPONSE_FINAL,
    RESPONSE_INDEX,
    Telemetry,
    record_error,
)

T = TypeVar("T")
R = TypeVar("R")


#: gRPC status code names by number.
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


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
    """`inference.GRPCInferenceService` over a `DataPlane`, with a span and metrics for each inference."""

    def __init__(
        self,
        plane: DataPlane,
        name: str,
        *,
        telemetry: Telemetry | None = None,
        metrics: Metrics | None = None,
        max_inflight_bytes: int | None = None,
    ) -> None:
        self.plane = plane
        self.name = name
        self.telemetry = telemetry or Telemetry()
        self.metrics = metrics or Metrics()
        #: The bytes of requests and responses in flight, against `max_inflight_bytes` (None: no limit).
        self.budget = budget = ByteBudget(max_inflight_bytes)
        self.metrics.gauge(
            "pipeline_inflight_bytes",
            "bytes of requests and responses this server holds in flight now (limit: --max-inflight-mb)",
            "server",
            lambda: [(name, budget.held)],
        )
        # Triton's nv_inference_* metrics: read from the same statistics ModelStatistics answers with.
        self.metrics.export_statistics(plane.statistics)
        #: The system shared-memory regions clients registered (Triton's extension).
        self.shared_memory = SharedMemoryRegistry()
        #: The port this server takes frames on (`pipeline.runtime.frame_server`), once it listens there.
        self.frames_port: int | None = None
        #: The requests being served, answered UNAVAILABLE where still held once a stop's grace period is over.
        self.held = HeldRequests()

    async def infer(self, request: pb.ModelInferRequest, call: RequestContext) -> pb.ModelInferResponse:
        """One inference through the plane: the request's server span (continuing the caller's trace)
        and its count and latency. Every front door (gRPC here, HTTP in `pipeline.router.frontdoor.http`) infers through
        this one path."""
        model = request.model_name
        started = time.perf_counter()
        outcome = "OK"
        telemetry = self.telemetry
        span_scope = (
            telemetry.server_span(
                f"ModelInfer {model}", call.metadata, {MODEL: model, REQUEST_ID: request.id}
            )
            if telemetry.enabled
            else NO_SPAN
        )
        with span_scope as span:
            try:
                shared = self.shared_memory
                shared.resolve_inputs(request)
                placed = shared.requested_outputs(request)
                with self.held:
                    response = await self.plane.infer(request, call)
                if placed:
                    shared.write_outputs(response, placed)
                return response
            except BaseException as err:
                outcome = outcome_of(err)
                if isinstance(err, ModelNotFound):
                    model = ""  # a client's made-up names must not become label values
                if span is not None and outcome != "CANCELLED":
                    record_error(span, err, outcome)
                raise
            finally:
                self.metrics.requests.labels(model, outcome).inc()
                if outcome == "OK":
                    self.metrics.request_duration.labels(model).observe(time.perf_counter() - started)

    async def stream(
        self,
        request: pb.ModelInferRequest,
        call: RequestContext,
        send: Callable[[pb.ModelStreamInferResponse], Awaitable[None]],
    ) -> None:
        """One streamed request for a decoupled model: each of its responses through `send` as it comes, a
        final flag sent alone only where the client asks for it (`triton_enable_empty_final_response`), a
        failure as an error response marked final. The request's span (with a span per response), count,
        latency and time to its first response."""
        empty_final = wants_empty_final(request)
        timeout, metadata = hop_context(request, call.metadata)
        model = request.model_name
        started = time.perf_counter()
        outcome = "OK"
        telemetry = self.telemetry
        span_scope = (
            telemetry.server_span(
                f"ModelStreamInfer {model}", metadata, {MODEL: model, REQUEST_ID: request.id}
            )
            if telemetry.enabled
            else NO_SPAN
        )
        with span_scope as span:
            try:
                with self.held:
                    responses = self.plane.stream(request, RequestContext(timeout, metadata))
                    async with contextlib.aclosing(responses):
                        count, since = 0, time.time_ns()
                        async for reply in responses:
                            if count == 0:
                                self.metrics.first_response.labels(model).observe(
                                    (time.perf_counter() - started) * 1e3
                                )
                            if reply.error_message:
                                outcome = _CODE_NAMES.get(status_of(reply).code, "UNKNOWN")
                            if span is not None:
                                since = _response_span(telemetry, request.id, count, is_final(reply), since)
                            count += 1
                            if empty_final or reply.error_message or not _final_flag_alone(reply):
                                await send(reply)
            except PipelineError as err:
                outcome = err.code.name
                await send(
                    set_final(error_response(request, err.code, err.message, rpc_status_of(err)), True)
                )
            except asyncio.CancelledError:
                outcome = "CANCELLED"
                raise
            except Exception:
                outcome = "INTERNAL"
                message = internal_error()
                await send(set_final(error_response(request, grpc.StatusCode.INTERNAL, message, None), True))
            finally:
                self.metrics.requests.labels(model, outcome).inc()
                if outcome == "OK":
                    self.metrics.request_duration.labels(model).observe(time.perf_counter() - started)

    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext):
        return pb.ServerReadyResponse(ready=self.plane.ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext):
        ready = self.plane.model_ready(request.name, request.version)
        return await _guarded(context, ready, lambda ready: pb.ModelReadyResponse(ready=ready))

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext):
        extensions = list(self.plane.extensions)
        if self.frames_port is not None:
            extensions.append(frames_extension(self.frames_port))
        return pb.ServerMetadataResponse(name=self.name, version=pipeline.__version__, extensions=extensions)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext):
        call = RequestContext.of(context)
        return await _guarded(context, self.plane.model_metadata(request.name, request.version, call))

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext):
        call = RequestContext.of(context)
        config = self.plane.model_config(request.name, request.version, call)
        return await _guarded(context, config, lambda config: pb.ModelConfigResponse(config=config))

    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext):
        return await _guarded(context, self._admitted(request, RequestContext.of(context)))

    async def ModelInferWithinBudget(self, requests: object, context: grpc.aio.ServicerContext):
        """`ModelInfer` as it is served (`pipeline.runtime.server`): a handler that reads its one request
        itself, once the budget of bytes in flight has room for it, so that a request refused while the
        budget is full is refused before gRPC received its message."""
        return await _guarded(context, self._read_admitted(context))

    async def _read_admitted(self, context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        budget = self.budget
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
            return await self.infer(request, RequestContext.of(context))
        finally:
            budget.release(cost)

    async def _admitted(self, request: pb.ModelInferRequest, call: RequestContext) -> pb.ModelInferResponse:
        """A unary request within the budget of bytes in flight, or refused before it is served (its
        response is handed to gRPC as it is made, so only what the request costs is held)."""
        self.budget.admit(cost := cost_of(request.ByteSize()))
        try:
            return await self.infer(request, call)
        finally:
            self.budget.release(cost)

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
        return await _guarded(context, _now(self.shared_memory.status, request.name))

    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: grpc.aio.ServicerContext
    ):
        register = self.shared_memory.register
        registered = _now(register, request.name, request.key, request.offset, request.byte_size)
        return await _guarded(context, registered, lambda _: pb.SystemSharedMemoryRegisterResponse())

    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: grpc.aio.ServicerContext
    ):
        unregistered = _now(self.shared_memory.unregister, request.name)
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
        stream = StreamRequests(self, RequestContext.of(context))
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


def _final_flag_alone(reply: pb.ModelStreamInferResponse) -> bool:
    """Whether a streamed response is the final flag alone: no outputs, no error."""
    return not reply.infer_response.outputs and is_final(reply)


def _response_span(telemetry: Telemetry, request_id: str, index: int, final: bool, since: int) -> int:
    """A span for one response of a streamed request, from the one before it (a child of the request's
    span); returns when it ended."""
    now = time.time_ns()
    attributes = {REQUEST_ID: request_id, RESPONSE_INDEX: index, RESPONSE_FINAL: final}
    telemetry.record_span(f"response {index}", since, now, attributes)
    return now

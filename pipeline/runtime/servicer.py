"""The protocol servicer every server shares: it hands each RPC to a `DataPlane` (a stage service's or the
router's) and maps the `PipelineError`s the plane raises to gRPC status codes, in one place."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

import pipeline
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import (
    ERROR_DOMAIN,
    NOT_STARTED,
    InvalidInput,
    ModelNotFound,
    PipelineError,
    Unavailable,
    Unimplemented,
)
from pipeline.protocol.frames import extension as frames_extension
from pipeline.protocol.sequence_line import SequenceLine, Turn
from pipeline.protocol.streams import (
    CANCEL_PARAMETER,
    EMPTY_FINAL_PARAMETER,
    STREAM_STATUS_EXTENSION,
    add_hop_parameters,
    error_response,
    hop_context,
    is_final,
    set_final,
    status_of,
    wants_empty_final,
)
from pipeline.runtime.admission import CONNECTION_INFLIGHT, ByteBudget, ModelShares, StreamHold, cost_of
from pipeline.runtime.call_abort import abort
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.security import DOOR_HEADER, IDENTITIES_HEADER
from pipeline.runtime.shared_memory import EXTENSION as SHARED_MEMORY_EXTENSION
from pipeline.runtime.shared_memory import SharedMemoryRegistry
from pipeline.runtime.shutdown import HeldRequests
from pipeline.runtime.telemetry import (
    MODEL,
    NO_SPAN,
    REQUEST_ID,
    RESPONSE_FINAL,
    RESPONSE_INDEX,
    Telemetry,
    record_error,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


#: gRPC status code names by number.
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}

#: The responses of a stream's decoupled requests held at once, past each request's first (see
#: `ModelStreamInfer`).
STREAM_INFLIGHT = 64

#: Metadata keys that belong to one hop and are not passed on to the next. The client's credentials are
#: the router's to check; the router calls its stages with credentials of its own (its stage token or its
#: client certificate), so a client's token never travels further.
_HOP_HEADERS = frozenset(
    {
        "user-agent",
        "content-type",
        "te",
        "grpc-timeout",
        "grpc-encoding",
        "host",
        "authorization",
        DOOR_HEADER,
        IDENTITIES_HEADER,
    }
)


@dataclass(frozen=True, slots=True)
class CallContext:
    """What the data plane needs of the incoming call: its time left and the client's metadata."""

    timeout: float | None
    metadata: tuple[tuple[str, str | bytes], ...]

    @classmethod
    def of(cls, context: grpc.aio.ServicerContext, *, credentials: bool = False) -> CallContext:
        """The call's time left and metadata; its `authorization` too with `credentials` (a repository change
        at the router, which the stages check as well), else never passed on."""
        metadata = tuple(
            (key, value)
            for key, value in (context.invocation_metadata() or ())
            if not key.startswith(":")
            and (key not in _HOP_HEADERS or (credentials and key == "authorization"))
        )
        return cls(context.time_remaining(), metadata)


class DataPlane(abc.ABC):
    """What a server does, free of gRPC types: model lookup, metadata, configuration and inference."""

    #: `ServerMetadata.extensions`: the protocol extensions this server supports.
    extensions: tuple[str, ...] = (
        "model_configuration",
        "statistics",
        SHARED_MEMORY_EXTENSION,
        STREAM_STATUS_EXTENSION,
    )

    #: The models that answer a request with any number of responses (decoupled), by name: served by
    #: `stream`, on streams only. Empty on a server that has none, which costs ordinary requests one check.
    decoupled: Collection[str] = frozenset()

    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether every model is ready to serve."""

    @abc.abstractmethod
    async def model_ready(self, name: str, version: str) -> bool:
        """Whether a model (at a version, or its default one) is ready."""

    @abc.abstractmethod
    async def model_metadata(self, name: str, version: str, call: CallContext) -> pb.ModelMetadataResponse:
        """`ModelMetadata` of a model; raises `ModelNotFound`."""

    @abc.abstractmethod
    async def model_config(self, name: str, version: str, call: CallContext) -> mc.ModelConfig:
        """Triton's `ModelConfig` of a model; raises `ModelNotFound`."""

    @abc.abstractmethod
    async def infer(self, request: pb.ModelInferRequest, call: CallContext) -> pb.ModelInferResponse:
        """Run one inference request."""

    def stream(
        self, request: pb.ModelInferRequest, call: CallContext
    ) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
        """A decoupled model's responses to one request as they come (an error is a response of its own),
        the last marked final (`pipeline.protocol.streams.set_final`), a final flag sent alone as a
        response without outputs. Only for the models in `decoupled`."""
        raise Unimplemented("this server has no decoupled models")

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        """Triton's `ModelStatistics`: every model's counters, or one model's (`name`)."""
        raise Unimplemented("this server keeps no statistics")

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        """Triton's `RepositoryIndex`: every model (version) in the repository and its state."""
        raise Unimplemented("this server has no model repository")

    async def repository_load(self, name: str, parameters: Mapping[str, object], call: CallContext) -> None:
        """Triton's `RepositoryModelLoad`: load or reload a model (`call`: the caller's time and metadata)."""
        raise Unimplemented("this server has no model repository")

    async def repository_unload(self, name: str, parameters: Mapping[str, object], call: CallContext) -> None:
        """Triton's `RepositoryModelUnload`: stop serving a model."""
        raise Unimplemented("this server has no model repository")


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


#: The most bytes of `BadRequest` details one error carries: with its message, base64 in a trailer, well
#: within the 8 KiB of metadata a gRPC client accepts by default (past it, the call fails RESOURCE_EXHAUSTED).
MAX_DETAILS_BYTES = 4096


def rpc_status_of(err: PipelineError) -> status_pb2.Status | None:
    """The `google.rpc.Status` of an error that has details: a `BadRequest` field violation `TENSOR[i]` per
    refused item (as many as `MAX_DETAILS_BYTES` holds), and `ErrorInfo` NOT_STARTED on an UNAVAILABLE (the call was refused before it started, so a
    client may send it to another replica). None for an error without details."""
    details = []
    if err.items:
        bad = error_details_pb2.BadRequest()
        size = 0
        for item in err.items:
            violation = bad.field_violations.add(field=item.field, description=item.description)
            size += violation.ByteSize() + 3
            if size > MAX_DETAILS_BYTES:
                # The first items only: the trailers must fit a client's 8 KiB metadata limit. A router
                # sends the rest of its batch again, and the items left unnamed are refused then.
                del bad.field_violations[-1]
                break
        details.append(bad)
    if isinstance(err, Unavailable):
        details.append(error_details_pb2.ErrorInfo(reason=NOT_STARTED, domain=ERROR_DOMAIN))
    if not details:
        return None
    status = status_pb2.Status(code=err.code.value[0], message=err.message)
    for detail in details:
        status.details.add().Pack(detail)
    return status


def status_details(err: PipelineError) -> tuple[tuple[str, bytes], ...]:
    """The `google.rpc.Status` details of an error, as trailing metadata (grpcio-status)."""
    status = rpc_status_of(err)
    return () if status is None else tuple(rpc_status.to_status(status).trailing_metadata)


def internal_error(error: BaseException | None = None) -> str:
    """Log `error` (by default the exception being handled) under a new incident id; return what the client
    is told instead."""
    incident = uuid.uuid4().hex[:12]
    log.error("internal error, incident %s", incident, exc_info=error or True)
    return f"internal error (incident {incident} in the server log)"


def outcome_of(err: BaseException) -> str:
    """The gRPC status code name a request that raised `err` is answered with."""
    if isinstance(err, PipelineError):
        return err.code.name
    if isinstance(err, asyncio.CancelledError):
        return "CANCELLED"
    return "INTERNAL"


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

    async def infer(self, request: pb.ModelInferRequest, call: CallContext) -> pb.ModelInferResponse:
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
        call: CallContext,
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
                    responses = self.plane.stream(request, CallContext(timeout, metadata))
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
        call = CallContext.of(context)
        return await _guarded(context, self.plane.model_metadata(request.name, request.version, call))

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext):
        call = CallContext.of(context)
        config = self.plane.model_config(request.name, request.version, call)
        return await _guarded(context, config, lambda config: pb.ModelConfigResponse(config=config))

    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext):
        return await _guarded(context, self._admitted(request, CallContext.of(context)))

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
            return await self.infer(request, CallContext.of(context))
        finally:
            budget.release(cost)

    async def _admitted(self, request: pb.ModelInferRequest, call: CallContext) -> pb.ModelInferResponse:
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
            request.model_name, params, CallContext.of(context, credentials=True)
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
            request.model_name, params, CallContext.of(context, credentials=True)
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
        (`ModelShares`): past it they are refused at once, and the others still run. `_Stream` reads and runs
        the requests; this writes their responses."""
        stream = _Stream(self, CallContext.of(context))
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


class _Stream:
    """The requests of one `ModelStreamInfer` stream: read while it has room, each run as a task of its
    own, its response put in `done` for the stream's writer. Each request takes a slot and its bytes when
    read; the writer gives them back once it has sent its response. A message with `CANCEL_PARAMETER`
    cancels the request of its `id`, as a unary call's cancellation would: it answers nothing, and gives
    back what it holds."""

    __slots__ = (
        "call",
        "closed",
        "decoupled",
        "done",
        "hold",
        "ids",
        "responses",
        "sequences",
        "servicer",
        "shares",
        "slots",
        "tasks",
    )

    def __init__(self, servicer: InferenceServicer, call: CallContext) -> None:
        self.servicer = servicer
        self.call = call
        self.done: asyncio.Queue[tuple[pb.ModelStreamInferResponse, int, asyncio.Semaphore] | None] = (
            asyncio.Queue()
        )
        self.slots = asyncio.Semaphore(CONNECTION_INFLIGHT)
        #: A decoupled request's responses past its first, not sent yet.
        self.responses = asyncio.Semaphore(STREAM_INFLIGHT)
        self.hold = StreamHold(servicer.budget, self.done, self.slots)
        self.shares = ModelShares(servicer.budget)
        self.tasks: set[asyncio.Task[None]] = set()
        #: The requests running, by their `id` (those that have one), for their cancellation.
        self.ids: dict[str, asyncio.Task[None]] = {}
        self.closed = False
        self.decoupled = servicer.plane.decoupled
        #: The requests of each sequence on this stream, in order: each waits for the one before it to be
        #: in line.
        self.sequences = SequenceLine()

    async def read(self, request_iterator: AsyncIterator[pb.ModelInferRequest]) -> None:
        """Start each request as it comes, while the stream has room; once the client is done and every
        request answered, put the end of the stream in `done`."""
        slots, hold, tasks, decoupled, sequences = (
            self.slots,
            self.hold,
            self.tasks,
            self.decoupled,
            self.sequences,
        )
        try:
            while True:
                await slots.acquire()
                await hold.wait_for_room()
                request = await request_iterator.__anext__()
                if request.parameters and CANCEL_PARAMETER in request.parameters:
                    slots.release()  # no request of its own
                    stopped = self.ids.get(request.id)
                    if stopped is not None:
                        stopped.cancel()
                    continue
                size = request.ByteSize()
                try:
                    self.shares.take(request.model_name, size)
                except PipelineError as err:
                    hold.put(error_response(request, err.code, err.message, rpc_status_of(err)))
                    continue
                await hold.take(size)
                if decoupled and request.model_name in decoupled:
                    task = asyncio.create_task(self.many(request, size))
                elif (turn := sequences.turn(request)) is not None:
                    # A sequence's requests go on in the order they came, each once the one before it is in
                    # line (as Triton's sequence batcher takes them); other requests run concurrently.
                    task = asyncio.create_task(self.after(turn, request, size))
                    task.add_done_callback(turn.done)
                else:
                    task = asyncio.create_task(self.one(request, size))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if request.id:
                    self.ids[request.id] = task
                    task.add_done_callback(functools.partial(_forget, self.ids, request.id))
                task.add_done_callback(functools.partial(self._answered, request.model_name, size))
        except StopAsyncIteration:
            pass
        while tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
        self.done.put_nowait(None)

    def _answered(self, model: str, size: int, _: asyncio.Task[None]) -> None:
        self.shares.free(model, size)

    async def one(self, request: pb.ModelInferRequest, size: int) -> None:
        """A request for a model that answers once: its response, or its error as a response."""
        call = self.call
        empty_final = bool(request.parameters) and wants_empty_final(request)
        timeout, metadata = hop_context(request, call.metadata)
        own = call if timeout is None and metadata is call.metadata else CallContext(timeout, metadata)
        try:
            response = pb.ModelStreamInferResponse(infer_response=await self.servicer.infer(request, own))
        except asyncio.CancelledError:
            self._dropped(size)
            raise
        except Unimplemented as err:
            if request.model_name in self.decoupled:
                # Its model was learnt to be decoupled while this request waited for it (its first
                # request, or an ensemble made available by this very request): refused before it ran, it
                # streams now, with the hop's parameters it came with (deadline, trace, final flag).
                add_hop_parameters(request, timeout, {k: v for k, v in metadata if isinstance(v, str)})
                if empty_final:
                    request.parameters[EMPTY_FINAL_PARAMETER].bool_param = True
                await self.many(request, size)
                return
            response = error_response(request, err.code, err.message, rpc_status_of(err))
        except PipelineError as err:
            response = error_response(request, err.code, err.message, rpc_status_of(err))
        except Exception:
            response = error_response(request, grpc.StatusCode.INTERNAL, internal_error(), None)
        self.hold.put(response, size)

    async def after(self, turn: Turn, request: pb.ModelInferRequest, size: int) -> None:
        """A sequence's request, once the one before it on this stream is in line."""
        try:
            await turn.wait()
        except asyncio.CancelledError:
            self._dropped(size)
            raise
        await self.one(request, size)

    def _dropped(self, size: int) -> None:
        """A request cancelled before its response: give back its slot and bytes (the stream's end gives
        back everything at once)."""
        if not self.closed:
            self.slots.release()
            self.hold.free(size)

    async def many(self, request: pb.ModelInferRequest, size: int) -> None:
        """A decoupled request. The reader took a slot and `size` bytes for it; each response after its
        first takes one of the stream's `responses`, which the writer gives back once it has sent it (the
        request's bytes and slot go back with its first response)."""
        responses, hold = self.responses, self.hold
        sent = 0

        async def send(reply: pb.ModelStreamInferResponse) -> None:
            nonlocal sent
            if sent:
                await responses.acquire()
                hold.put(reply, 0, responses)
            else:
                hold.put(reply, size)
            sent += 1

        try:
            await self.servicer.stream(request, self.call, send)
        finally:
            if not sent:
                self._dropped(size)

    def close(self) -> None:
        """The stream ended (or its client went): cancel what still runs, give back what it holds."""
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        self.hold.close()


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


def _forget(tasks: dict[str, asyncio.Task[None]], key: str, done: asyncio.Task[None]) -> None:
    """Drop a finished request of an id unless a later one of it came since."""
    if tasks.get(key) is done:
        del tasks[key]

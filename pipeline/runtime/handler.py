"""Every door's one inference handler, free of any transport: `InferenceHandler` holds what a server's
requests share, whichever door they came in by (the gRPC servicer, `pipeline.runtime.servicer`; the frame
port, `pipeline.transport.frame_server`, which also takes the compiled front's traffic; the router's HTTP/REST,
`pipeline.router.frontdoor.http`), and runs each inference over the server's `DataPlane`: the budget of bytes
in flight, the access policy, spans, metrics and statistics, the shared-memory regions, the requests held for
a stop. A door only translates its transport to these calls and their results back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import grpc

import pipeline
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import ModelNotFound, PipelineError
from pipeline.protocol.frames import extension as frames_extension
from pipeline.protocol.streams import (
    error_response,
    hop_context,
    is_final,
    set_final,
    status_of,
    wants_empty_final,
)
from pipeline.runtime.admission import ByteBudget
from pipeline.runtime.data_plane import DataPlane, RequestContext
from pipeline.runtime.error_status import internal_error, outcome_of, rpc_status_of
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.security import AccessPolicy
from pipeline.runtime.server_settings import Limits
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

#: gRPC status code names by number.
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class InferenceHandler:
    """A server's requests over its `plane`, whatever door they came in by: each inference's span (continuing
    the caller's trace), count and latency, its shared-memory inputs and outputs, and the budget of bytes in
    flight (`limits.max_inflight_bytes`) every door admits its requests against; `policy` says who may call
    what, at every door."""

    def __init__(
        self,
        plane: DataPlane,
        name: str,
        limits: Limits | None = None,
        *,
        policy: AccessPolicy | None = None,
        telemetry: Telemetry | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.plane = plane
        self.name = name
        self.policy = policy or AccessPolicy()
        self.telemetry = telemetry or Telemetry()
        self.metrics = metrics or Metrics()
        #: The bytes of requests and responses in flight, against `--max-inflight-mb`.
        self.budget = budget = ByteBudget((limits or Limits()).max_inflight_bytes)
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
        #: The port this server takes frames on (`pipeline.transport.frame_server`), once it listens there.
        self.frames_port: int | None = None
        #: The requests being served, answered UNAVAILABLE where still held once a stop's grace period is over.
        self.held = HeldRequests()

    def server_metadata(self) -> pb.ServerMetadataResponse:
        """`ServerMetadata`: the server's name, version and extensions (its frame port's among them)."""
        extensions = list(self.plane.extensions)
        if self.frames_port is not None:
            extensions.append(frames_extension(self.frames_port))
        return pb.ServerMetadataResponse(name=self.name, version=pipeline.__version__, extensions=extensions)

    async def infer(self, request: pb.ModelInferRequest, call: RequestContext) -> pb.ModelInferResponse:
        """One inference through the plane: the request's server span (continuing the caller's trace), its
        shared-memory inputs and outputs, and its count and latency. The door has admitted the request
        against the `budget` first, as its transport allows (before reading it, where it can)."""
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
                if call.requests == 1:
                    self.metrics.requests.labels(model, outcome).inc()
                    if outcome == "OK":
                        self.metrics.request_duration.labels(model).observe(time.perf_counter() - started)
                else:
                    self._count_merged(model, outcome, call, time.perf_counter() - started)

    def _count_merged(self, model: str, outcome: str, call: RequestContext, seconds: float) -> None:
        """The metrics of a call carrying several requests (merged by the compiled front): each counted."""
        count = call.requests if outcome == "OK" else call.failures(outcome)
        if count:
            self.metrics.requests.labels(model, outcome).inc(count)
        if outcome == "OK":
            duration = self.metrics.request_duration.labels(model)
            for _ in range(count):
                duration.observe(seconds)

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

"""The router: serves every ensemble as a model and runs its steps on the stage services.

Each step runs as soon as the tensors it consumes exist, so independent steps run concurrently (fan-out)
and a step that consumes several steps' outputs waits for all of them (fan-in). Tensors move between
stages as raw bytes; the router never decodes elements. The client's deadline and metadata go with every
stage call. As Triton does for an ensemble's composing models, the stage models named in steps are served
here too, by forwarding to their stage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.trace import Span, SpanKind

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.batching import BatchingConfig, DynamicBatcher
from pipeline.config import ConfigError, load_ensembles
from pipeline.convert import (
    Tensor,
    infer_response,
    metadata_response,
    model_config,
    pad_values,
    request_tensors,
    requested_outputs,
    response_tensors,
    select_version,
    specs_from_metadata,
    validate_inputs,
)
from pipeline.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelNotFound,
    PipelineError,
    StageError,
    Unavailable,
)
from pipeline.merge import StageCall, TensorBatching
from pipeline.metrics import Metrics
from pipeline.plan import Catalog, EnsemblePlan, ModelSignature, PlanStep, StageEndpoint, check_signatures
from pipeline.rest import RestFrontDoor, RestServer, add_http_arguments
from pipeline.security import (
    AuthInterceptor,
    SecurityConfigError,
    add_auth_arguments,
    add_client_tls_arguments,
    authenticator_of,
    channel_credentials,
    server_credentials_of,
)
from pipeline.server import (
    INFERENCE_SERVICE,
    CallContext,
    DataPlane,
    InferenceServicer,
    add_server_arguments,
    configure_logging,
    create_server,
    positive_int,
    serve,
    server_options,
    set_serving,
    start_metrics,
    write_port,
)
from pipeline.statistics import ModelStats
from pipeline.telemetry import (
    ENSEMBLE,
    MODEL,
    NO_SPAN,
    PEER,
    REQUEST_ID,
    STAGE,
    STEP,
    Telemetry,
)

log = logging.getLogger(__name__)

ENSEMBLE_VERSION = "1"


#: How the router reaches a stage's replicas. A target that resolves to several addresses (a `dns:///`
#: name of a scaled service, or `ipv4:a:p,b:p`) is spread round robin; a call that finds a replica gone
#: (UNAVAILABLE: nothing was processed) is retried on another, within the request's deadline. Stage calls
#: are idempotent, so a retry is safe. gRPC's client-side health checking watches each replica's health
#: service: a replica that says NOT_SERVING (loading, or draining after SIGTERM) gets no new calls until it
#: says SERVING again; a server without the Watch RPC counts as healthy.
STAGE_SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    # Round robin skips a replica whose health service says NOT_SERVING (one that is draining).
    "healthCheckConfig": {"serviceName": ""},
    "methodConfig": [
        {
            "name": [{"service": "inference.GRPCInferenceService"}],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
}
STAGE_CHANNEL_OPTIONS = [
    ("grpc.service_config", json.dumps(STAGE_SERVICE_CONFIG)),
    ("grpc.enable_retries", 1),
    # Look the name up again soon after a replica goes away or a connection is recycled.
    ("grpc.dns_min_time_between_resolutions_ms", 1000),
]


@dataclass(frozen=True, slots=True)
class StageRetry:
    """The router's own retries of a stage call that failed UNAVAILABLE, on top of gRPC's retry policy.

    gRPC retries transparently only calls that never reached a server, or whose request still fits its
    retry buffer (256 KiB) and whose server never answered; a call in flight to a replica that dies with a
    larger request (a batch of images) fails UNAVAILABLE ("Socket closed"). Stage calls are idempotent, so
    the router calls again, on whichever replica the balancer picks, with backoff, within the deadline.
    """

    #: Calls in all, the first included.
    attempts: int = 4
    initial_backoff: float = 0.05
    max_backoff: float = 0.5
    multiplier: float = 2.0

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1, 2, ...): exponential, with jitter so that the
        calls that failed together do not return together."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        return random.uniform(ceiling / 2, ceiling)


def _tls_name(address: str) -> str | None:
    """The name a stage's certificate must carry when the target itself names none: an `ipv4:a,b` list's
    authority is the whole list, so its first host stands for every replica."""
    if not address.startswith(("ipv4:", "ipv6:")):
        return None
    first = address.split(":", 1)[1].split(",", 1)[0]
    host = first.rsplit(":", 1)[0] if first.count(":") == 1 or first.startswith("[") else first
    return host.strip("[]")


class StageClient:
    """One stage endpoint: a channel, its stubs, and the mapping of its failures to router errors."""

    def __init__(
        self,
        endpoint: StageEndpoint,
        *,
        max_message_bytes: int,
        metrics: Metrics | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        retry: StageRetry | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.metrics = metrics
        self.retry = retry or StageRetry()
        options = [*server_options(max_message_bytes), *STAGE_CHANNEL_OPTIONS]
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(endpoint.address, options=options)
        else:
            override = _tls_name(endpoint.address)
            if override is not None:
                options.append(("grpc.ssl_target_name_override", override))
            self.channel = grpc.aio.secure_channel(endpoint.address, credentials, options=options)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False
        limit = endpoint.max_inflight_requests
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None

    async def call(
        self,
        method: str,
        request: object,
        *,
        timeout: float | None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        what: str,
    ):
        """Call an RPC of the stage within `timeout` (retries included); `what` names the step or model in
        errors. `ModelInfer` calls wait for one of the stage's `max_inflight_requests` slots first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        slots = self._slots if method == "ModelInfer" else None
        if slots is not None:
            await self._acquire(slots, deadline, what)
        try:
            return await self._call(method, request, deadline, tuple(metadata), what)
        finally:
            if slots is not None:
                slots.release()

    async def _acquire(self, slots: asyncio.Semaphore, deadline: float | None, what: str) -> None:
        if deadline is None:
            await slots.acquire()
            return
        try:
            await asyncio.wait_for(slots.acquire(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded(
                f"deadline exceeded waiting for stage '{self.endpoint.name}' "
                f"(max_inflight_requests {self.endpoint.max_inflight_requests}) for {what}"
            ) from None

    async def _call(
        self,
        method: str,
        request: object,
        deadline: float | None,
        metadata: tuple[tuple[str, str | bytes], ...],
        what: str,
    ):
        name, address = self.endpoint.name, self.endpoint.address
        attempt = 0
        while True:
            attempt += 1
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"deadline exceeded in {what} on stage '{name}'")
            try:
                reply = await getattr(self.stub, method)(request, timeout=remaining, metadata=metadata)
            except grpc.aio.AioRpcError as err:
                code, details = err.code(), err.details() or ""
                if self.metrics is not None:
                    self.metrics.stage_calls.labels(name, code.name).inc()
                if code == grpc.StatusCode.UNAVAILABLE:
                    delay = self.retry.backoff(attempt)
                    if (
                        attempt < self.retry.attempts
                        and (deadline is None or time.monotonic() + delay < deadline)
                        and self._may_answer()
                    ):
                        log.debug("retrying %s on stage '%s' in %.3fs: %s", what, name, delay, details)
                        await asyncio.sleep(delay)
                        continue
                    self.healthy = False
                    raise Unavailable(
                        f"stage '{name}' ({address}) is unavailable for {what}: {details}"
                    ) from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise DeadlineExceeded(f"deadline exceeded in {what} on stage '{name}'") from None
                raise StageError(f"{what} on stage '{name}': {details}", code) from None
            if self.metrics is not None:
                self.metrics.stage_calls.labels(name, "OK").inc()
            return reply

    def _may_answer(self) -> bool:
        """Whether a retry can reach a replica: not when every replica is down (the channel is in
        TRANSIENT_FAILURE), so that a stage that is down fails its requests fast."""
        state = self.channel.get_state(try_to_connect=False)
        return state != grpc.ChannelConnectivity.TRANSIENT_FAILURE

    async def check_health(self, timeout: float) -> bool:
        """Ask the stage's health service; remember and return whether it is SERVING."""
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            self.healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            self.healthy = False
        return self.healthy

    async def close(self) -> None:
        await self.channel.close()


class RouterPlane(DataPlane):
    """The router's data plane: ensembles run as DAGs of stage calls; stage models are forwarded."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        max_message_bytes: int = 64 * 1024 * 1024,
        telemetry: Telemetry | None = None,
        metrics: Metrics | None = None,
        stage_credentials: grpc.ChannelCredentials | None = None,
        max_inflight_requests: int = 0,
        max_batch_items: int = 0,
    ) -> None:
        """`stage_credentials`: TLS for the stage calls. `max_inflight_requests`: inference requests the
        router holds at once (more are refused UNAVAILABLE at once, so memory stays bounded under overload;
        0: no limit). `max_batch_items`: items (dimension 0) one request may carry (0: no limit)."""
        self.catalog = catalog
        self.telemetry = telemetry or Telemetry()
        self.metrics = metrics or Metrics()
        self.max_inflight_requests = max_inflight_requests
        self.max_batch_items = max_batch_items
        self._inflight = 0
        self.clients = {
            key: StageClient(
                endpoint,
                max_message_bytes=max_message_bytes,
                metrics=self.metrics,
                credentials=stage_credentials,
            )
            for key, endpoint in catalog.stages.items()
        }
        self.stage_of_model: dict[str, str] = catalog.stage_models()
        self.signatures: dict[str, ModelSignature] = {}
        self.batchers: dict[str, tuple[DynamicBatcher[StageCall, dict[str, Tensor]], TensorBatching]] = {}
        # Per ensemble, and per stage model called without batching (batchers keep their own).
        self.stats: dict[str, ModelStats] = {
            name: ModelStats() for name in (*catalog.ensembles, *self.stage_of_model)
        }
        batchers = self.batchers
        clients = self.clients
        self.metrics.gauge(
            "pipeline_queue_depth",
            "Requests waiting now",
            "model",
            lambda: [(model, b.queue_depth) for model, (b, _) in batchers.items()],
        )
        self.metrics.gauge(
            "pipeline_inflight_batches",
            "Executions running now",
            "model",
            lambda: [(model, b.inflight_batches) for model, (b, _) in batchers.items()],
        )
        self.metrics.gauge(
            "pipeline_stage_healthy",
            "1 when the stage's health check says SERVING",
            "stage",
            lambda: [(key, float(c.healthy)) for key, c in clients.items()],
        )

    # --- start-up and health -------------------------------------------------------------------------

    async def discover(self, *, retry_interval: float = 0.5) -> None:
        """Learn every stage model's signature from its stage, waiting for stages that are not up yet,
        then check every ensemble against them (a mismatch raises `ConfigError`)."""
        waiting_since = time.monotonic()
        reported: set[str] = set()
        while len(self.signatures) < len(self.stage_of_model):
            for model, key in self.stage_of_model.items():
                if model in self.signatures:
                    continue
                try:
                    self.signatures[model] = await self._signature(model, self.clients[key])
                except PipelineError as err:
                    if model not in reported or time.monotonic() - waiting_since > 30:
                        log.info("waiting for model '%s' on stage '%s': %s", model, key, err.message)
                        reported.add(model)
            if len(self.signatures) < len(self.stage_of_model):
                await asyncio.sleep(retry_interval)
        for plan in self.catalog.ensembles.values():
            check_signatures(plan, self.signatures)
        for plan in self.catalog.ensembles.values():
            for step in plan.steps:
                if step.batching is not None and step.model_name not in self.batchers:
                    self._add_batcher(step.model_name, step.batching)
        # Metadata answers before a stage has loaded its models: wait for every stage to be SERVING too.
        while not all(await asyncio.gather(*(c.check_health(timeout=2.0) for c in self.clients.values()))):
            await asyncio.sleep(retry_interval)

    def _add_batcher(self, model: str, config: BatchingConfig) -> None:
        signature = self.signatures[model]
        if signature.max_batch_size and config.max_batch_size > signature.max_batch_size:
            raise ConfigError(
                f"model '{model}': dynamic_batching max_batch_size {config.max_batch_size} is larger than the "
                f"stage model's own max_batch_size {signature.max_batch_size}"
            )
        client = self.clients[self.stage_of_model[model]]
        tensors = TensorBatching(signature)
        name = f"stage '{client.endpoint.name}' (model '{model}')"

        async def execute(calls: Sequence[StageCall]) -> list[dict[str, Tensor] | BaseException]:
            return await self._execute_batch(model, client, tensors, calls)

        batcher: DynamicBatcher[StageCall, dict[str, Tensor]] = DynamicBatcher(
            name, execute, config, telemetry=self.telemetry, metrics=self.metrics, model=model
        )
        batcher.start()
        self.batchers[model] = (batcher, tensors)

    async def _signature(self, model: str, client: StageClient) -> ModelSignature:
        what = f"model '{model}'"
        meta = await client.call("ModelMetadata", pb.ModelMetadataRequest(name=model), timeout=2.0, what=what)
        inputs, outputs = specs_from_metadata(meta.inputs), specs_from_metadata(meta.outputs)
        try:
            reply = await client.call(
                "ModelConfig", pb.ModelConfigRequest(name=model), timeout=2.0, what=what
            )
            max_batch_size = reply.config.max_batch_size
            padding = pad_values(reply.config)
            inputs = tuple(replace(s, pad_value=padding.get(s.name)) for s in inputs)
            outputs = tuple(replace(s, pad_value=padding.get(s.name)) for s in outputs)
        except StageError as err:
            if err.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            # A plain OIP server without Triton's ModelConfig: a leading -1 everywhere means it batches.
            batching = all(spec.shape[:1] == (-1,) for spec in (*inputs, *outputs))
            max_batch_size = sys.maxsize if batching else 0
        return ModelSignature(model, inputs, outputs, max_batch_size)

    async def monitor(
        self, interval: float = 1.0, on_ready: Callable[[bool], Awaitable[None]] | None = None
    ) -> None:
        """Keep each stage's health current, so readiness reflects stages that stop or return; `on_ready`
        hears of every change of `ready()` (the router's health service reports it)."""
        was_ready: bool | None = None
        while True:
            await asyncio.gather(*(c.check_health(timeout=interval) for c in self.clients.values()))
            ready = self.ready()
            if ready != was_ready and on_ready is not None:
                await on_ready(ready)
            if ready != was_ready and was_ready is not None:
                log.info(
                    "router %s", "ready: every stage is serving" if ready else "not ready: a stage is down"
                )
            was_ready = ready
            await asyncio.sleep(interval)

    def ready(self) -> bool:
        return len(self.signatures) == len(self.stage_of_model) and all(
            c.healthy for c in self.clients.values()
        )

    async def close(self) -> None:
        await asyncio.gather(*(batcher.aclose() for batcher, _ in self.batchers.values()))
        await asyncio.gather(*(c.close() for c in self.clients.values()))

    # --- model lookup --------------------------------------------------------------------------------

    def _ensemble(self, name: str, version: str) -> EnsemblePlan | None:
        plan = self.catalog.ensembles.get(name)
        if plan is not None:
            select_version(name, (ENSEMBLE_VERSION,), version)
        return plan

    def _stage_client(self, name: str) -> StageClient:
        key = self.stage_of_model.get(name)
        if key is None:
            served = sorted([*self.catalog.ensembles, *self.stage_of_model])
            raise ModelNotFound(f"unknown model '{name}' (served here: {', '.join(served)})")
        return self.clients[key]

    async def model_ready(self, name: str, version: str) -> bool:
        try:
            plan = self._ensemble(name, version)
        except ModelNotFound:
            return False
        if plan is not None:
            return self.ready() and all(self.clients[step.stage].healthy for step in plan.steps)
        if name not in self.stage_of_model:
            return False
        try:
            reply = await self._stage_client(name).call(
                "ModelReady",
                pb.ModelReadyRequest(name=name, version=version),
                timeout=2.0,
                what=f"model '{name}'",
            )
        except PipelineError:
            return False
        return reply.ready

    async def model_metadata(self, name: str, version: str, call: CallContext) -> pb.ModelMetadataResponse:
        plan = self._ensemble(name, version)
        if plan is not None:
            return metadata_response(plan.name, (ENSEMBLE_VERSION,), "ensemble", plan.inputs, plan.outputs)
        request = pb.ModelMetadataRequest(name=name, version=version)
        return await self._stage_client(name).call(
            "ModelMetadata", request, timeout=call.timeout, metadata=call.metadata, what=f"model '{name}'"
        )

    async def model_config(self, name: str, version: str, call: CallContext) -> mc.ModelConfig:
        plan = self._ensemble(name, version)
        if plan is not None:
            return ensemble_config(plan)
        request = pb.ModelConfigRequest(name=name, version=version)
        reply = await self._stage_client(name).call(
            "ModelConfig", request, timeout=call.timeout, metadata=call.metadata, what=f"model '{name}'"
        )
        return reply.config

    # --- inference -----------------------------------------------------------------------------------

    async def infer(self, request: pb.ModelInferRequest, call: CallContext) -> pb.ModelInferResponse:
        limit = self.max_inflight_requests
        if limit and self._inflight >= limit:
            # NOTE: refused before anything is kept or queued: under overload the router sheds load at the
            # door instead of holding every request's tensors until it runs out of memory.
            raise Unavailable(
                f"the router is saturated: {self._inflight} requests in flight (max_inflight_requests "
                f"{limit}); retry later"
            )
        self._inflight += 1
        try:
            return await self._infer(request, call)
        finally:
            self._inflight -= 1

    def _check_items(self, request: pb.ModelInferRequest, batching: bool) -> None:
        """Refuse a request carrying more items (dimension 0) than `max_batch_items` allows."""
        limit = self.max_batch_items
        if not limit or not batching:
            return
        for tensor in request.inputs:
            if tensor.shape and tensor.shape[0] > limit:
                raise InvalidInput(
                    f"input '{tensor.name}': {tensor.shape[0]} batch items, more than a request may carry "
                    f"here ({limit}, max_batch_items)"
                )

    async def _infer(self, request: pb.ModelInferRequest, call: CallContext) -> pb.ModelInferResponse:
        plan = self._ensemble(request.model_name, request.model_version)
        name = request.model_name
        if plan is not None:
            self._check_items(request, plan.max_batch_size > 0)
        elif (signature := self.signatures.get(name)) is not None:
            self._check_items(request, signature.max_batch_size > 0)
        batched = plan is None and name in self.batchers
        started = time.perf_counter_ns()
        # A batched stage model's statistics are its batcher's (queue and batch figures included).
        stats = None if batched else self.stats.get(name)
        try:
            if plan is not None:
                if self.telemetry.enabled and (span := self.telemetry.current_span()) is not None:
                    span.set_attribute(ENSEMBLE, plan.name)
                response, items = await self._run(plan, request, call)
            elif batched:
                response, items = await self._infer_batched(request, call)
            else:
                client = self._stage_client(name)
                with self._stage_call_span(name, client) if self.telemetry.enabled else NO_SPAN:
                    response = await client.call(
                        "ModelInfer",
                        request,
                        timeout=call.timeout,
                        metadata=self.telemetry.inject(call.metadata),
                        what=f"model '{name}'",
                    )
                items = _items(
                    self.signatures.get(name), response.outputs[0].shape if response.outputs else ()
                )
        except BaseException:
            if stats is not None:
                stats.request_failed(time.perf_counter_ns() - started)
            raise
        if stats is not None:
            elapsed = time.perf_counter_ns() - started
            # NOTE: an ensemble (like a forwarded call) executes once per request, taking it whole.
            stats.request_done(items=items, total_ns=elapsed, compute_ns=elapsed)
            stats.batch_done(items, elapsed)
        return response

    def _stage_call_span(self, model: str, client: StageClient, **attributes: Any):
        """The span of one unbatched stage call; its context goes to the stage in the call's metadata."""
        return self.telemetry.span(
            f"ModelInfer {model}",
            {MODEL: model, STAGE: client.endpoint.name, PEER: client.endpoint.address, **attributes},
            kind=SpanKind.CLIENT,
        )

    async def _infer_batched(
        self, request: pb.ModelInferRequest, call: CallContext
    ) -> tuple[pb.ModelInferResponse, int]:
        """A client's call of a stage model that has a batcher: it queues like the ensembles' calls."""
        name = request.model_name
        signature = self.signatures[name]
        batcher, _ = self.batchers[name]
        inputs = validate_inputs(
            name, request_tensors(request), signature.inputs, batcher.config.max_batch_size
        )
        wanted = requested_outputs(request, signature.outputs, name)
        deadline = None if call.timeout is None else time.monotonic() + call.timeout
        stage_call = StageCall(inputs, tuple(wanted), request.model_version, deadline)
        outputs = await self._submit(
            name, stage_call, deadline, request.parameters, self.telemetry.current_span()
        )
        response = infer_response(name, request.model_version, request.id, (outputs[n] for n in wanted))
        return response, stage_call.size

    async def _submit(
        self,
        model: str,
        stage_call: StageCall,
        deadline: float | None,
        parameters: Mapping[str, pb.InferParameter],
        span: Span | None = None,
    ) -> dict[str, Tensor]:
        batcher, tensors = self.batchers[model]
        priority = batcher.priority_of(_int_parameter(parameters, "priority"))
        return await batcher.submit(
            stage_call,
            size=stage_call.size,
            key=tensors.key(stage_call),
            deadline=batcher.deadline_of(deadline, _int_parameter(parameters, "timeout")),
            priority=priority,
            span=span,
        )

    async def _execute_batch(
        self, model: str, client: StageClient, tensors: TensorBatching, calls: Sequence[StageCall]
    ) -> list[dict[str, Tensor] | BaseException]:
        """One stage call for a batch of requests; an item the stage refuses fails only its request."""
        request = pb.ModelInferRequest(model_name=model, model_version=calls[0].version)
        for tensor in tensors.merge(calls):
            request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            request.raw_input_contents.append(tensor.raw)
        for name in dict.fromkeys(name for call in calls for name in call.outputs):
            request.outputs.add(name=name)
        what = f"a batch of {len(calls)} requests for model '{model}'"
        metadata: Sequence[tuple[str, str | bytes]] = ()
        if self.telemetry.enabled:
            # The batcher made the batch span current: the stage continues it.
            span = self.telemetry.current_span()
            if span is not None:
                span.set_attributes({STAGE: client.endpoint.name, PEER: client.endpoint.address})
            metadata = self.telemetry.inject(())
        # The batch's deadline is its last member's: the stage works on while anyone still waits for it.
        deadlines = [call.deadline for call in calls]
        timeout = None
        if all(d is not None for d in deadlines):
            timeout = max(deadlines) - time.monotonic()  # type: ignore[type-var]
            if timeout <= 0:
                raise DeadlineExceeded(f"deadline exceeded before {what} was sent")
        try:
            response = await client.call("ModelInfer", request, timeout=timeout, metadata=metadata, what=what)
        except StageError as err:
            culprit = _item_error(err, calls) if len(calls) > 1 else None
            if culprit is None:
                raise
            # Answer the request whose item was refused, and run the others again without it.
            index, error = culprit
            if self.telemetry.enabled and (span := self.telemetry.current_span()) is not None:
                span.add_event("item refused; the rest sent again", {"pipeline.batch.item": index})
            rest = [call for i, call in enumerate(calls) if i != index]
            results = await self._execute_batch(model, client, tensors, rest)
            results.insert(index, error)
            return results
        return list(tensors.split(response_tensors(response), calls))

    async def _run(
        self, plan: EnsemblePlan, request: pb.ModelInferRequest, call: CallContext
    ) -> tuple[pb.ModelInferResponse, int]:
        inputs = validate_inputs(plan.name, request_tensors(request), plan.inputs, plan.max_batch_size)
        wanted = requested_outputs(request, plan.outputs, plan.name)
        deadline = None if call.timeout is None else time.monotonic() + call.timeout
        values: dict[str, Tensor] = dict(inputs)
        finished = {step.index: asyncio.Event() for step in plan.steps}

        telemetry = self.telemetry

        async def run_step(step: PlanStep) -> None:
            for producer in step.depends_on:
                await finished[producer].wait()
            if telemetry.enabled:
                attributes = {
                    ENSEMBLE: plan.name,
                    STEP: step.index,
                    MODEL: step.model_name,
                    STAGE: step.stage,
                    REQUEST_ID: request.id,
                }
                with telemetry.span(f"step {step.model_name}", attributes):
                    outputs = await self._call_step(step, values, request, deadline, call.metadata)
            else:
                outputs = await self._call_step(step, values, request, deadline, call.metadata)
            values.update(outputs)
            finished[step.index].set()

        try:
            # NOTE: a failing step makes the TaskGroup cancel every other step of this request, so no
            # stage call outlives the request it belongs to.
            async with asyncio.TaskGroup() as group:
                for step in plan.steps:
                    group.create_task(run_step(step))
        except BaseExceptionGroup as failure:
            raise _first_error(failure) from None
        response = infer_response(plan.name, ENSEMBLE_VERSION, request.id, (values[name] for name in wanted))
        items = next(iter(inputs.values())).shape[0] if plan.max_batch_size > 0 and inputs else 1
        return response, items

    async def _call_step(
        self,
        step: PlanStep,
        values: Mapping[str, Tensor],
        request: pb.ModelInferRequest,
        deadline: float | None,
        metadata: Sequence[tuple[str, str | bytes]],
    ) -> dict[str, Tensor]:
        if step.model_name in self.batchers:
            stage_call = StageCall(
                {stage_tensor: values[name] for stage_tensor, name in step.inputs},
                tuple(stage_tensor for stage_tensor, _ in step.outputs),
                step.model_version,
                deadline,
            )
            try:
                produced = await self._submit(
                    step.model_name, stage_call, deadline, request.parameters, self.telemetry.current_span()
                )
            except StageError as err:
                raise StageError(f"{step.label}: {err.message}", err.code) from None
        else:
            produced = await self._call_stage(step, values, request.id, deadline, metadata)
        outputs = {}
        for stage_tensor, tensor_name in step.outputs:
            tensor = produced.get(stage_tensor)
            if tensor is None:
                raise StageError(
                    f"{step.label} on stage '{step.stage}' returned no output '{stage_tensor}'",
                    grpc.StatusCode.INTERNAL,
                )
            outputs[tensor_name] = Tensor(tensor_name, tensor.datatype, tensor.shape, tensor.raw)
        return outputs

    async def _call_stage(
        self,
        step: PlanStep,
        values: Mapping[str, Tensor],
        request_id: str,
        deadline: float | None,
        metadata: Sequence[tuple[str, str | bytes]],
    ) -> dict[str, Tensor]:
        """One request, one stage call: the step's model has no batcher."""
        stage_request = pb.ModelInferRequest(
            model_name=step.model_name, model_version=step.model_version, id=request_id
        )
        for stage_tensor, tensor_name in step.inputs:
            tensor = values[tensor_name]
            stage_request.inputs.add(name=stage_tensor, datatype=tensor.datatype, shape=tensor.shape)
            stage_request.raw_input_contents.append(tensor.raw)
        for stage_tensor, _ in step.outputs:
            stage_request.outputs.add(name=stage_tensor)
        timeout = None
        if deadline is not None:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise DeadlineExceeded(f"deadline exceeded before {step.label}")
        client = self.clients[step.stage]
        stats = self.stats[step.model_name]
        first = stage_request.inputs[0].shape if stage_request.inputs else ()
        items = _items(self.signatures.get(step.model_name), first)
        started = time.perf_counter_ns()
        try:
            if self.telemetry.enabled:
                with self._stage_call_span(step.model_name, client, **{REQUEST_ID: request_id}):
                    response = await client.call(
                        "ModelInfer",
                        stage_request,
                        timeout=timeout,
                        metadata=self.telemetry.inject(metadata),
                        what=step.label,
                    )
            else:
                response = await client.call(
                    "ModelInfer", stage_request, timeout=timeout, metadata=metadata, what=step.label
                )
        except BaseException:
            stats.request_failed(time.perf_counter_ns() - started)
            raise
        elapsed = time.perf_counter_ns() - started
        stats.request_done(items=items, total_ns=elapsed, compute_ns=elapsed)
        stats.batch_done(items, elapsed)
        self.metrics.compute_duration.labels(step.model_name).observe(elapsed / 1e9)
        self.metrics.batch_size.labels(step.model_name).observe(items)
        return response_tensors(response)

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        names = [name] if name else sorted(self.stats)
        reply = pb.ModelStatisticsResponse()
        for model in names:
            if model in self.batchers:
                stats = self.batchers[model][0].stats
            elif model in self.stats:
                stats = self.stats[model]
            else:
                raise ModelNotFound(f"unknown model '{model}'")
            reply.model_stats.append(stats.proto(model, version or ENSEMBLE_VERSION))
        return reply


def _items(signature: ModelSignature | None, shape: Sequence[int]) -> int:
    """Batch items in a tensor of `shape` for a model: dimension 0 if the model batches, else 1."""
    if signature is not None and signature.max_batch_size > 0 and len(shape) > 0:
        return int(shape[0])
    return 1


_ITEM = re.compile(r"\b[A-Za-z_][\w.]*\[(\d+)\]")


def _item_error(err: StageError, calls: Sequence[StageCall]) -> tuple[int, StageError] | None:
    """Which request of a batch a stage's INVALID_ARGUMENT `NAME[i]: ...` is about, with i made its own."""
    if err.code != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    match = _ITEM.search(err.message)
    if match is None:
        return None
    row = int(match.group(1))
    offset = 0
    for index, call in enumerate(calls):
        if row < offset + call.size:
            local = err.message[: match.start(1)] + str(row - offset) + err.message[match.end(1) :]
            return index, StageError(local, err.code)
        offset += call.size
    return None


def _int_parameter(parameters: Mapping[str, pb.InferParameter], key: str) -> int | None:
    """A request parameter given as int64 or uint64 (`priority`, `timeout`), or None."""
    if key not in parameters:
        return None
    param = parameters[key]
    choice = param.WhichOneof("parameter_choice")
    if choice in ("int64_param", "uint64_param"):
        return int(getattr(param, choice))
    raise InvalidInput(f"request parameter '{key}' must be an integer, got {choice}")


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error to report for a failed ensemble: the first `PipelineError` a step raised (it says what was
    wrong), else the first error of any kind."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        err = pending.pop(0)
        if isinstance(err, BaseExceptionGroup):
            pending[:0] = err.exceptions
        else:
            leaves.append(err)
    return next((e for e in leaves if isinstance(e, PipelineError)), leaves[0] if leaves else group)


def ensemble_config(plan: EnsemblePlan) -> mc.ModelConfig:
    """Triton's `ModelConfig` of an ensemble: platform "ensemble" and its steps."""
    config = model_config(
        plan.name,
        platform="ensemble",
        max_batch_size=plan.max_batch_size,
        inputs=plan.inputs,
        outputs=plan.outputs,
    )
    for step in sorted(plan.steps, key=lambda s: s.index):
        entry = config.ensemble_scheduling.step.add(
            model_name=step.model_name, model_version=int(step.model_version or -1)
        )
        for stage_tensor, tensor_name in step.inputs:
            entry.input_map[stage_tensor] = tensor_name
        for stage_tensor, tensor_name in step.outputs:
            entry.output_map[stage_tensor] = tensor_name
    return config


# --- process entry point -----------------------------------------------------------------------------


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, service="router", default_port=8001, default_metrics_port=8002)
    parser.add_argument(
        "--ensembles",
        type=Path,
        nargs="+",
        default=[Path(os.environ.get("PIPELINE_ENSEMBLES", "ensembles"))],
        help="ensemble YAML files or folders of them (env PIPELINE_ENSEMBLES)",
    )
    parser.add_argument(
        "--max-inflight-requests",
        type=int,
        default=int(os.environ.get("PIPELINE_MAX_INFLIGHT_REQUESTS", 1024)),
        help="inference requests held at once; more are refused with UNAVAILABLE, so memory stays bounded "
        "under overload; 0 for no limit (env PIPELINE_MAX_INFLIGHT_REQUESTS; default %(default)s)",
    )
    parser.add_argument(
        "--max-batch-items",
        type=positive_int,
        default=int(os.environ.get("PIPELINE_MAX_BATCH_ITEMS", 1024)),
        help="items (dimension 0) one request may carry, whatever the model allows "
        "(env PIPELINE_MAX_BATCH_ITEMS; default %(default)s)",
    )
    add_http_arguments(parser)
    add_auth_arguments(parser)
    add_client_tls_arguments(parser, prefix="stage-", env_prefix="PIPELINE_STAGE_")


async def serve_router(
    args: argparse.Namespace,
    *,
    catalog: Catalog | None = None,
    stopping: asyncio.Event | None = None,
    bound: Callable[[int], None] | None = None,
    telemetry: Telemetry | None = None,
    metrics: Metrics | None = None,
    http_bound: Callable[[int], None] | None = None,
) -> None:
    """Serve the ensembles until a signal (or `stopping`): listen, wait for the stages and check the plans,
    then SERVING. `bound` is called with the port once the server listens (`http_bound` with the HTTP
    port, first). `telemetry` defaults to tracing configured by the environment, `metrics` to a registry
    of this server's own."""
    if catalog is None:
        catalog = load_ensembles(args.ensembles)
    owned = telemetry is None
    telemetry = Telemetry.from_env("router") if telemetry is None else telemetry
    metrics = Metrics() if metrics is None else metrics
    authenticator = authenticator_of(args)
    plane = RouterPlane(
        catalog,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        telemetry=telemetry,
        metrics=metrics,
        stage_credentials=channel_credentials(
            getattr(args, "stage_tls_ca", None),
            getattr(args, "stage_tls_cert", None),
            getattr(args, "stage_tls_key", None),
        ),
        max_inflight_requests=getattr(args, "max_inflight_requests", 0),
        max_batch_items=getattr(args, "max_batch_items", 0),
    )
    health_servicer = health.aio.HealthServicer()
    await set_serving(health_servicer, False)
    servicer = InferenceServicer(plane, "pipeline-router", telemetry=telemetry, metrics=metrics)
    rest = RestServer(
        RestFrontDoor(
            servicer, authenticator=authenticator, max_body_bytes=args.max_message_mb * 1024 * 1024
        ),
        grace=args.grace_period,
    )
    server, port = await create_server(
        f"{args.host}:{args.port}",
        servicer,
        health_servicer,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        credentials=server_credentials_of(args),
        interceptors=[AuthInterceptor(authenticator)] if authenticator is not None else (),
    )
    monitor: asyncio.Task[None] | None = None

    async def readiness(ready: bool) -> None:
        # "" is liveness: SERVING from the end of start-up until shutdown, whatever the stages do, so
        # that no probe restarts a router that only waits for a stage. The inference service is readiness:
        # SERVING exactly while ServerReady is true (every stage healthy).
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await health_servicer.set(INFERENCE_SERVICE, status)

    async def start() -> None:
        nonlocal monitor
        start_metrics(metrics, args)
        await rest.start(args, http_bound)
        write_port(args.port_file, port)
        if bound is not None:
            bound(port)
        log.info(
            "router listening on %s:%d; waiting for stages %s", args.host, port, ", ".join(plane.clients)
        )
        await plane.discover()
        await set_serving(health_servicer, True)
        monitor = asyncio.create_task(plane.monitor(on_ready=readiness))
        log.info("router serving ensembles %s on %s:%d", ", ".join(catalog.ensembles), args.host, port)

    async def stop() -> None:
        if monitor is not None:
            monitor.cancel()
        await rest.stop()
        await plane.close()
        metrics.close()
        if owned:
            # Flushing may wait on an exporter's endpoint: not on the event loop.
            await asyncio.to_thread(telemetry.shutdown)

    await serve(
        server,
        health_servicer,
        grace=args.grace_period,
        start=start,
        stop=stop,
        stopping=stopping,
        drain_delay=getattr(args, "drain_delay", 0.0),
    )


def run_router(args: argparse.Namespace) -> int:
    """Entry point of the router process."""
    configure_logging(args.log_level, "router")
    try:
        asyncio.run(serve_router(args))
    except (ConfigError, SecurityConfigError) as err:
        log.error("%s", err)
        return 2
    return 0

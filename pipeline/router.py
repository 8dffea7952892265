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
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
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
from pipeline.server import (
    CallContext,
    DataPlane,
    InferenceServicer,
    add_server_arguments,
    configure_logging,
    create_server,
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
#: are idempotent, so a retry is safe.
STAGE_SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
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


class StageClient:
    """One stage endpoint: a channel, its stubs, and the mapping of its failures to router errors."""

    def __init__(
        self, endpoint: StageEndpoint, *, max_message_bytes: int, metrics: Metrics | None = None
    ) -> None:
        self.endpoint = endpoint
        self.metrics = metrics
        self.channel = grpc.aio.insecure_channel(
            endpoint.address, options=[*server_options(max_message_bytes), *STAGE_CHANNEL_OPTIONS]
        )
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False

    async def call(
        self,
        method: str,
        request: object,
        *,
        timeout: float | None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        what: str,
    ):
        """Call an RPC of the stage; `what` names the step or model in errors."""
        name, address = self.endpoint.name, self.endpoint.address
        try:
            reply = await getattr(self.stub, method)(request, timeout=timeout, metadata=tuple(metadata))
        except grpc.aio.AioRpcError as err:
            code, details = err.code(), err.details() or ""
            if self.metrics is not None:
                self.metrics.stage_calls.labels(name, code.name).inc()
            if code == grpc.StatusCode.UNAVAILABLE:
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
    ) -> None:
        self.catalog = catalog
        self.telemetry = telemetry or Telemetry()
        self.metrics = metrics or Metrics()
        self.clients = {
            key: StageClient(endpoint, max_message_bytes=max_message_bytes, metrics=self.metrics)
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

    async def monitor(self, interval: float = 1.0) -> None:
        """Keep each stage's health current, so readiness reflects stages that stop or return."""
        while True:
            await asyncio.gather(*(c.check_health(timeout=interval) for c in self.clients.values()))
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
        plan = self._ensemble(request.model_name, request.model_version)
        name = request.model_name
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
        stage_call = StageCall(inputs, tuple(wanted), request.model_version)
        deadline = None if call.timeout is None else time.monotonic() + call.timeout
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
        try:
            response = await client.call("ModelInfer", request, timeout=None, metadata=metadata, what=what)
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
    """The error to report for a failed ensemble: the first `PipelineError` a step raised."""
    for err in group.exceptions:
        if isinstance(err, BaseExceptionGroup):
            return _first_error(err)
        return err
    return group


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


async def serve_router(
    args: argparse.Namespace,
    *,
    catalog: Catalog | None = None,
    stopping: asyncio.Event | None = None,
    bound: Callable[[int], None] | None = None,
    telemetry: Telemetry | None = None,
    metrics: Metrics | None = None,
) -> None:
    """Serve the ensembles until a signal (or `stopping`): listen, wait for the stages and check the plans,
    then SERVING. `bound` is called with the port once the server listens. `telemetry` defaults to tracing
    configured by the environment, `metrics` to a registry of this server's own."""
    if catalog is None:
        catalog = load_ensembles(args.ensembles)
    owned = telemetry is None
    telemetry = Telemetry.from_env("router") if telemetry is None else telemetry
    metrics = Metrics() if metrics is None else metrics
    plane = RouterPlane(
        catalog, max_message_bytes=args.max_message_mb * 1024 * 1024, telemetry=telemetry, metrics=metrics
    )
    health_servicer = health.aio.HealthServicer()
    await set_serving(health_servicer, False)
    server, port = await create_server(
        f"{args.host}:{args.port}",
        InferenceServicer(plane, "pipeline-router", telemetry=telemetry, metrics=metrics),
        health_servicer,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
    )
    monitor: asyncio.Task[None] | None = None

    async def start() -> None:
        nonlocal monitor
        start_metrics(metrics, args)
        write_port(args.port_file, port)
        if bound is not None:
            bound(port)
        log.info(
            "router listening on %s:%d; waiting for stages %s", args.host, port, ", ".join(plane.clients)
        )
        await plane.discover()
        monitor = asyncio.create_task(plane.monitor())
        await set_serving(health_servicer, True)
        log.info("router serving ensembles %s on %s:%d", ", ".join(catalog.ensembles), args.host, port)

    async def stop() -> None:
        if monitor is not None:
            monitor.cancel()
        await plane.close()
        metrics.close()
        if owned:
            # Flushing may wait on an exporter's endpoint: not on the event loop.
            await asyncio.to_thread(telemetry.shutdown)

    await serve(server, health_servicer, grace=args.grace_period, start=start, stop=stop, stopping=stopping)


def run_router(args: argparse.Namespace) -> int:
    """Entry point of the router process."""
    configure_logging(args.log_level, "router")
    try:
        asyncio.run(serve_router(args))
    except ConfigError as err:
        log.error("%s", err)
        return 2
    return 0

"""The DAG executor: runs an ensemble's steps on the stage services, batched or one call per request.

Each step runs as soon as the tensors it consumes exist, so independent steps run concurrently (fan-out)
and a step that consumes several steps' outputs waits for all of them (fan-in). Tensors move between
stages as raw bytes; the router never decodes elements. The client's deadline and metadata go with every
stage call. A stage model with a batcher gets its calls queued and merged into one `ModelInfer` per batch,
split back by offsets (`pipeline.router.merge`); an item the stage refuses fails only the request that carried it.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import grpc
from opentelemetry.trace import Span, SpanKind

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import EnsemblePlan, ModelSignature, PlanStep, check_signatures
from pipeline.protocol.codec import (
    Tensor,
    infer_response,
    request_tensors,
    requested_outputs,
    response_tensors,
    validate_inputs,
)
from pipeline.protocol.datatypes import element_count
from pipeline.protocol.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ItemError,
    PipelineError,
    StageError,
)
from pipeline.protocol.types import BatchingConfig, TensorSpec
from pipeline.router.batching import DynamicBatcher
from pipeline.router.merge import StageCall, TensorBatching
from pipeline.router.stage_client import StageClient
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.servicer import CallContext
from pipeline.runtime.statistics import ModelStats
from pipeline.runtime.telemetry import (
    ENSEMBLE,
    MODEL,
    PEER,
    REQUEST_ID,
    SKIP_REASON,
    STAGE,
    STEP,
    STEP_SKIPPED,
    Telemetry,
)

log = logging.getLogger(__name__)

#: The version the router reports for every ensemble.
ENSEMBLE_VERSION = "1"


class Executor:
    """Runs ensemble plans and batched stage-model calls on the stages' clients.

    `signatures` (each stage model's interface, learnt at start-up), `batchers` (per batched stage model)
    and `stats` (per ensemble and per stage model called without batching) are filled by the router.
    """

    def __init__(self, clients: Mapping[str, StageClient], *, telemetry: Telemetry, metrics: Metrics) -> None:
        self.clients = clients
        self.telemetry = telemetry
        self.metrics = metrics
        self.signatures: dict[str, ModelSignature] = {}
        self.batchers: dict[str, tuple[DynamicBatcher[StageCall, dict[str, Tensor]], TensorBatching]] = {}
        self.stats: dict[str, ModelStats] = {}
        #: Told (model, version asked for, version that answered) of every stage response: the router's
        #: response cache learns from it which version serves a model now.
        self.on_version: Callable[[str, str, str], None] | None = None
        self._branch_counters: dict[tuple[str, int, bool], Any] = {}
        #: (ensemble, step index) of the steps whose stage model declares no tensors and whose first
        #: response has been checked against the ensemble.
        self._checked: set[tuple[str, int]] = set()

    def add_batcher(self, model: str, client: StageClient, config: BatchingConfig) -> None:
        """Queue the calls of `model` (on `client`'s stage) and send them as batches, as `config` says; raises
        `ConfigError` when the batches would be larger than the model takes."""
        signature = self.signatures[model]
        if signature.max_batch_size and config.max_batch_size > signature.max_batch_size:
            raise ConfigError(
                f"model '{model}': dynamic_batching max_batch_size {config.max_batch_size} is larger than the "
                f"stage model's own max_batch_size {signature.max_batch_size}"
            )
        tensors = TensorBatching(signature)
        name = f"stage '{client.endpoint.name}' (model '{model}')"

        async def execute(calls: Sequence[StageCall]) -> list[dict[str, Tensor] | BaseException]:
            return await self._execute_batch(model, client, tensors, calls)

        batcher: DynamicBatcher[StageCall, dict[str, Tensor]] = DynamicBatcher(
            name,
            execute,
            config,
            telemetry=self.telemetry,
            metrics=self.metrics,
            model=model,
            replicas=lambda: client.replicas.ready_count,
        )
        client.replicas.listeners.append(batcher.replicas_changed)
        batcher.start()
        self.batchers[model] = (batcher, tensors)

    def stage_call_span(self, model: str, client: StageClient, **attributes: Any):
        """The span of one unbatched stage call; its context goes to the stage in the call's metadata."""
        return self.telemetry.span(
            f"ModelInfer {model}",
            {MODEL: model, STAGE: client.endpoint.name, PEER: client.endpoint.address, **attributes},
            kind=SpanKind.CLIENT,
        )

    async def infer_batched(
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
        outputs = await self.submit(
            name, stage_call, deadline, request.parameters, self.telemetry.current_span()
        )
        response = infer_response(name, request.model_version, request.id, (outputs[n] for n in wanted))
        return response, stage_call.size

    async def submit(
        self,
        model: str,
        stage_call: StageCall,
        deadline: float | None,
        parameters: Mapping[str, pb.InferParameter],
        span: Span | None = None,
        *,
        expected: bool = False,
    ) -> dict[str, Tensor]:
        batcher, tensors = self.batchers[model]
        try:
            priority = batcher.priority_of(_int_parameter(parameters, "priority"))
            queue_deadline = batcher.deadline_of(deadline, _int_parameter(parameters, "timeout"))
            key = tensors.key(stage_call)
        except BaseException:
            if expected:
                batcher.unexpect()
            raise
        return await batcher.submit(
            stage_call,
            size=stage_call.size,
            key=key,
            deadline=queue_deadline,
            priority=priority,
            span=span,
            expected=expected,
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
        deadlines = [call.deadline for call in calls if call.deadline is not None]
        timeout = None
        if len(deadlines) == len(calls):
            timeout = max(deadlines) - time.monotonic()
            if timeout <= 0:
                raise DeadlineExceeded(f"deadline exceeded before {what} was sent")
        try:
            response = await client.call("ModelInfer", request, timeout=timeout, metadata=metadata, what=what)
        except StageError as err:
            refused = _item_errors(err, calls) if len(calls) > 1 else {}
            if not refused or len(refused) == len(calls):
                if refused:  # every request carried a bad item: each hears of its own
                    return [refused[i] for i in range(len(calls))]
                raise
            # Answer the requests whose items were refused, and send the others again without them: one
            # more stage call, however many items were bad (the stage reports them all).
            if self.telemetry.enabled and (span := self.telemetry.current_span()) is not None:
                span.add_event(
                    "items refused; the rest sent again", {"pipeline.batch.items": sorted(refused)}
                )
            rest = [call for i, call in enumerate(calls) if i not in refused]
            answers = iter(await self._execute_batch(model, client, tensors, rest))
            return [refused[i] if i in refused else next(answers) for i in range(len(calls))]
        if self.on_version is not None:
            self.on_version(model, calls[0].version, response.model_version)
        return list(tensors.split(response_tensors(response), calls))

    async def run(
        self, plan: EnsemblePlan, request: pb.ModelInferRequest, call: CallContext
    ) -> tuple[pb.ModelInferResponse, int]:
        """Run an ensemble's steps for one request: its response and the items (dimension 0) it carried."""
        inputs = validate_inputs(plan.name, request_tensors(request), plan.inputs, plan.max_batch_size)
        wanted = requested_outputs(request, plan.outputs, plan.name)
        deadline = None if call.timeout is None else time.monotonic() + call.timeout
        values: dict[str, Tensor] = dict(inputs)
        finished = {step.index: asyncio.Event() for step in plan.steps}
        # Tell each batched step's batcher that this request is on its way, so that under load a partial
        # batch may wait for it (`BatchingConfig.batch_upcoming`); whatever never arrives is taken back.
        awaited = {
            step.index: self.batchers[step.model_name][0]
            for step in plan.steps
            if step.model_name in self.batchers
        }
        for batcher in awaited.values():
            batcher.expect()

        telemetry = self.telemetry
        conditional = plan.conditional

        async def run_step(step: PlanStep) -> None:
            for producer in step.depends_on:
                await finished[producer].wait()
            attributes: dict[str, Any] = {}
            if telemetry.enabled:
                attributes = {
                    ENSEMBLE: plan.name,
                    STEP: step.index,
                    MODEL: step.model_name,
                    STAGE: step.stage,
                    REQUEST_ID: request.id,
                }
            if conditional:
                skipped = self._skip_reason(plan, step, values)
                self._branch_counter(plan.name, step, not skipped).inc()
                if skipped:
                    if telemetry.enabled:
                        skip = {**attributes, STEP_SKIPPED: True, SKIP_REASON: skipped}
                        with telemetry.span(f"step {step.model_name}", skip):
                            pass
                    batcher = awaited.pop(step.index, None)
                    if batcher is not None:
                        batcher.unexpect()  # it will not come: its batch need not wait for it
                    finished[step.index].set()
                    return
            if telemetry.enabled:
                with telemetry.span(f"step {step.model_name}", attributes):
                    outputs = await self._call_step(step, values, request, deadline, call.metadata, awaited)
            else:
                outputs = await self._call_step(step, values, request, deadline, call.metadata, awaited)
            if (plan.name, step.index) not in self._checked:
                # A request that came before the model's signature was learnt is not checked; a later one is.
                signature = self.signatures.get(step.model_name)
                if signature is not None and not signature.declared:
                    self._check_first_response(plan, step, values, outputs)
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
        finally:
            for batcher in awaited.values():
                batcher.unexpect()
        # An optional output that no step produced on this request's path is left out of the response.
        response = infer_response(
            plan.name, ENSEMBLE_VERSION, request.id, (values[name] for name in wanted if name in values)
        )
        items = next(iter(inputs.values())).shape[0] if plan.max_batch_size > 0 and inputs else 1
        return response, items

    def _branch_counter(self, ensemble: str, step: PlanStep, taken: bool) -> Any:
        """The `pipeline_branch_requests_total` child of a step and outcome, looked up once."""
        key = (ensemble, step.index, taken)
        counter = self._branch_counters.get(key)
        if counter is None:
            counter = self._branch_counters[key] = self.metrics.branch_requests.labels(
                ensemble, f"{step.index}:{step.model_name}", "true" if taken else "false"
            )
        return counter

    @staticmethod
    def _skip_reason(plan: EnsemblePlan, step: PlanStep, values: Mapping[str, Tensor]) -> str:
        """Why a request skips a step ("" when it runs): an input that no step produced for it, or a
        condition that does not hold. A condition tensor holding other than one element is refused."""
        missing = [tensor for tensor in step.consumed if tensor not in values]
        if missing:
            return f"no tensor {', '.join(repr(t) for t in missing)} (its producer was skipped)"
        when = step.when
        if when is None:
            return ""
        value = condition_value(values[when.tensor], f"ensemble '{plan.name}' {step.label}")
        if when.holds(value):
            return ""
        return f"condition not met: {when} (value {value!r})"

    async def _call_step(
        self,
        step: PlanStep,
        values: Mapping[str, Tensor],
        request: pb.ModelInferRequest,
        deadline: float | None,
        metadata: Sequence[tuple[str, str | bytes]],
        awaited: dict[int, DynamicBatcher[StageCall, dict[str, Tensor]]],
    ) -> dict[str, Tensor]:
        if step.model_name in self.batchers:
            stage_call = StageCall(
                {stage_tensor: values[name] for stage_tensor, name in step.inputs},
                tuple(stage_tensor for stage_tensor, _ in step.outputs),
                step.model_version,
                deadline,
            )
            expected = awaited.pop(step.index, None) is not None
            try:
                produced = await self.submit(
                    step.model_name,
                    stage_call,
                    deadline,
                    request.parameters,
                    self.telemetry.current_span(),
                    expected=expected,
                )
            except StageError as err:
                raise StageError(f"{step.label}: {err.message}", err.code, items=err.items) from None
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

    def _check_first_response(
        self, plan: EnsemblePlan, step: PlanStep, values: Mapping[str, Tensor], outputs: Mapping[str, Tensor]
    ) -> None:
        """Check a step whose stage model declares no tensors, on its first response: the tensors sent and
        received stand for its signature, and the ensemble is checked with it as `check_signatures` checks
        declared models at start-up. A mismatch fails the request (and the next, until the stage answers
        what the ensemble expects), naming the step and the tensor."""
        batched = plan.max_batch_size > 0

        def spec(name: str, tensor: Tensor) -> TensorSpec:
            shape = tuple(tensor.shape)
            return TensorSpec(name, tensor.datatype, (-1, *shape[1:]) if batched and shape else shape)

        learnt = replace(
            self.signatures[step.model_name],
            inputs=tuple(spec(stage_tensor, values[name]) for stage_tensor, name in step.inputs),
            outputs=tuple(spec(stage_tensor, outputs[name]) for stage_tensor, name in step.outputs),
        )
        try:
            check_signatures(plan, {**self.signatures, step.model_name: learnt})
        except ConfigError as err:
            raise StageError(
                f"{step.label}: the first response of stage model '{step.model_name}', which declares no "
                f"tensors, does not fit the ensemble: {err}",
                grpc.StatusCode.INTERNAL,
            ) from None
        log.info(
            "%s: %s: stage model '%s' answered as the ensemble expects (%s)",
            plan.source,
            step.label,
            step.model_name,
            ", ".join(f"{s.name} {s.datatype} {list(s.shape)}" for s in (*learnt.inputs, *learnt.outputs)),
        )
        self._checked.add((plan.name, step.index))

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
        items = batch_items(self.signatures.get(step.model_name), first)
        started = time.perf_counter_ns()
        try:
            if self.telemetry.enabled:
                with self.stage_call_span(step.model_name, client, **{REQUEST_ID: request_id}):
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
        if self.on_version is not None:
            self.on_version(step.model_name, step.model_version, response.model_version)
        return response_tensors(response)

    async def close(self) -> None:
        """Stop every batcher (queued requests fail)."""
        await asyncio.gather(*(batcher.aclose() for batcher, _ in self.batchers.values()))


def condition_value(tensor: Tensor, where: str) -> float | str:
    """The single value a condition reads: a number, or a BYTES element as text. A tensor holding any other
    number of elements (a request of several items, say) is refused: a condition reads one per request."""
    if element_count(tensor.shape) != 1:
        raise InvalidInput(
            f"{where}: condition tensor '{tensor.name}' holds {element_count(tensor.shape)} elements "
            f"(shape {list(tensor.shape)}); a condition reads exactly one value per request, so send one "
            "item per request to this ensemble"
        )
    value = tensor.to_array().reshape(-1)[0]
    if tensor.datatype == "BYTES":
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(f"{where}: condition tensor '{tensor.name}' is not UTF-8 text") from None
    return float(value)


def batch_items(signature: ModelSignature | None, shape: Sequence[int]) -> int:
    """Batch items in a tensor of `shape` for a model: dimension 0 if the model batches, else 1."""
    if signature is not None and signature.max_batch_size > 0 and len(shape) > 0:
        return int(shape[0])
    return 1


#: A foreign stage's refusal names its item only in the message (`NAME[i]: ...`); ours send details.
_ITEM = re.compile(r"\b([A-Za-z_][\w.]*)\[(\d+)\]")


def _item_errors(err: StageError, calls: Sequence[StageCall]) -> dict[int, StageError]:
    """Which requests of a batch a stage's INVALID_ARGUMENT refused, each with its own error (its items'
    indices made its own). The items come from the error's `BadRequest` details; from a stage that sends
    none, the first `NAME[i]` of the message."""
    if err.code != grpc.StatusCode.INVALID_ARGUMENT:
        return {}
    items = list(err.items)
    if not items:
        match = _ITEM.search(err.message)
        if match is None:
            return {}
        items = [ItemError(match.group(1), int(match.group(2)), err.message[match.end() :].lstrip(": "))]
    starts = list(itertools.accumulate((call.size for call in calls), initial=0))
    mine: dict[int, list[ItemError]] = {}
    for item in items:
        index = bisect.bisect_right(starts, item.index) - 1
        if not 0 <= index < len(calls) or item.index >= starts[-1]:
            return {}  # an index outside the batch: the error is not about items of this batch
        mine.setdefault(index, []).append(
            ItemError(item.tensor, item.index - starts[index], item.description)
        )
    return {
        index: StageError(InvalidInput.for_items(own).message, err.code, items=own)
        for index, own in mine.items()
    }


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

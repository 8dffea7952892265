"""The DAG executor: runs an ensemble's steps on the stage services, batched or one call per request.

Each step runs as soon as the tensors it consumes exist, so independent steps run concurrently (fan-out)
and a step that consumes several steps' outputs waits for all of them (fan-in). Tensors move between
stages as raw bytes; the router never decodes elements. The client's deadline and metadata go with every
stage call. Each step's stage call goes through `pipeline.router.scheduling.dispatch`, which decides whether
it is batched; in an ensemble with conditions, whether a request takes a step is
`pipeline.router.execution.branches`'s to say.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import EnsemblePlan, ModelSignature, PlanStep
from pipeline.ensemble.signatures import check_signatures
from pipeline.protocol.codec import (
    Tensor,
    infer_response,
    request_tensors,
    requested_outputs,
    validate_inputs,
)
from pipeline.protocol.errors import (
    ConfigError,
    InvalidInput,
    PipelineError,
    StageError,
)
from pipeline.protocol.types import TensorSpec
from pipeline.router.execution.branches import Branches
from pipeline.router.execution.fanout import gather, split
from pipeline.router.registry import ENSEMBLE_VERSION, ModelRegistry
from pipeline.router.scheduling.dispatch import Announcement, StageDispatcher
from pipeline.router.stages.stage_client import StageClient
from pipeline.runtime.data_plane import RequestContext
from pipeline.runtime.error_status import outcome_of
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.telemetry import MODEL, STEP, Telemetry

log = logging.getLogger(__name__)


class Executor:
    """Runs ensemble plans: each step's stage call goes through the `dispatcher`, which decides whether it is
    batched (and hears which batched steps a request is on its way to); the `registry` gives the signatures
    and statistics; `clients` are the stages' by key. Whether a request takes a conditional step is asked
    of `branches`."""

    def __init__(
        self,
        registry: ModelRegistry,
        clients: Mapping[str, StageClient],
        dispatcher: StageDispatcher,
        *,
        telemetry: Telemetry,
        metrics: Metrics,
    ) -> None:
        self.registry = registry
        self.clients = clients
        self.dispatcher = dispatcher
        self.telemetry = telemetry
        self.branches = Branches(telemetry, metrics)
        #: (ensemble, step index) of the steps whose stage model declares no tensors and whose first
        #: response has been checked against the ensemble.
        self._checked: set[tuple[str, int]] = set()

    async def infer(
        self, plan: EnsemblePlan, request: pb.ModelInferRequest, call: RequestContext
    ) -> pb.ModelInferResponse:
        """One request for an ensemble, counted in the ensemble's statistics (as the requests it carries,
        where the front merged several: `RequestContext.requests`)."""
        stats = self.registry.stats.get(plan.name)
        started = time.perf_counter_ns()
        try:
            response, items = await self.run(plan, request, call)
        except BaseException as err:
            if stats is not None:
                failed = call.failures(outcome_of(err))
                if failed:
                    stats.request_failed(time.perf_counter_ns() - started, failed)
            raise
        if stats is not None:
            elapsed = time.perf_counter_ns() - started
            # NOTE: an ensemble executes once per request, taking it whole.
            requests = call.requests
            stats.requests_done(requests, items=items, total_ns=elapsed * requests, compute_ns=elapsed)
            stats.batch_done(items, elapsed)
        return response

    async def run(
        self, plan: EnsemblePlan, request: pb.ModelInferRequest, call: RequestContext
    ) -> tuple[pb.ModelInferResponse, int]:
        """Run an ensemble's steps for one request: its response and the items (dimension 0) it carried."""
        inputs = validate_inputs(plan.name, request_tensors(request), plan.inputs, plan.max_batch_size)
        wanted = requested_outputs(request, plan.outputs, plan.name)
        deadline = None if call.timeout is None else time.monotonic() + call.timeout
        values: dict[str, Tensor] = dict(inputs)
        # NOTE: the front's batches are not announced: the front sends the next one only when one comes back.
        announced = Announcement() if call.front_batched else self.dispatcher.announce(plan)
        try:
            if plan.linear:
                # A chain: each step waits for the one before it anyway, so they run in this task, with
                # no task or event of their own.
                for step in plan.steps:
                    await self._run_step(plan, step, request, call, deadline, values, announced, None)
            else:
                finished = {step.index: asyncio.Event() for step in plan.steps}
                # NOTE: a failing step makes the TaskGroup cancel every other step of this request, so no
                # stage call outlives the request it belongs to.
                async with asyncio.TaskGroup() as group:
                    for step in plan.steps:
                        group.create_task(
                            self._run_step(plan, step, request, call, deadline, values, announced, finished)
                        )
        except BaseExceptionGroup as failure:
            raise _first_error(failure) from None
        finally:
            announced.release()
        # An optional output that no step produced on this request's path is left out of the response.
        response = infer_response(
            plan.name, ENSEMBLE_VERSION, request.id, (values[name] for name in wanted if name in values)
        )
        items = next(iter(inputs.values())).shape[0] if plan.max_batch_size > 0 and inputs else 1
        return response, items

    async def _run_step(
        self,
        plan: EnsemblePlan,
        step: PlanStep,
        request: pb.ModelInferRequest,
        call: RequestContext,
        deadline: float | None,
        values: dict[str, Tensor],
        announced: Announcement,
        finished: dict[int, asyncio.Event] | None,
    ) -> None:
        """Run one step of a request once the steps it depends on have `finished` (None: a chain, run in
        order), its outputs added to `values`: skipped where its condition says so, else its stage called."""
        if finished is not None:
            for producer in step.depends_on:
                await finished[producer].wait()
        telemetry = self.telemetry
        attributes: dict[str, Any] = {}
        if telemetry.enabled:
            # NOTE: the ensemble and the request id are on the request's span, the parent of this one.
            # Every attribute costs each traced request its encoding, so none is repeated here.
            attributes = {STEP: step.index, MODEL: step.model_name}
        if plan.conditional and self.branches.skipped(plan, step, values, attributes, announced):
            if finished is not None:
                finished[step.index].set()
            return
        if telemetry.enabled:
            with telemetry.span(f"step {step.model_name}", attributes):
                outputs = await self.call_step(
                    step, values, request, deadline, call.metadata, announced, call.requests
                )
        else:
            outputs = await self.call_step(
                step, values, request, deadline, call.metadata, announced, call.requests
            )
        if (plan.name, step.index) not in self._checked:
            # A request that came before the model's signature was learnt is not checked; a later one is.
            signatures = self.registry.signatures
            signature = signatures.get(step.model_name)
            if signature is not None and not signature.declared:
                _check_first_response(plan, step, signatures, values, outputs)
                self._checked.add((plan.name, step.index))
        values.update(outputs)
        if finished is not None:
            finished[step.index].set()

    async def call_step(
        self,
        step: PlanStep,
        values: Mapping[str, Tensor],
        request: pb.ModelInferRequest,
        deadline: float | None,
        metadata: Sequence[tuple[str, str | bytes]],
        announced: Announcement,
        requests: int = 1,
    ) -> dict[str, Tensor]:
        """One step's call of its stage model (one per element for a fan-out step), batched or not as the
        dispatcher decides: its outputs by the ensemble's tensor names. `requests`: how many clients'
        requests the call carries (the compiled front's merged ones), each counted in the model's statistics."""
        if step.for_each:
            return await self._fan_out(step, values, request, deadline, metadata, announced)
        inputs = {stage_tensor: values[name] for stage_tensor, name in step.inputs}
        produced = await self.dispatcher.call_step(
            self.clients[step.stage], step, inputs, request, deadline, metadata, announced, requests
        )
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

    async def _fan_out(
        self,
        step: PlanStep,
        values: Mapping[str, Tensor],
        request: pb.ModelInferRequest,
        deadline: float | None,
        metadata: Sequence[tuple[str, str | bytes]],
        announced: Announcement,
    ) -> dict[str, Tensor]:
        """A fan-out step: one call per element of its `for_each` tensors (each a request of one item, so
        the elements of many requests share the model's batches), the outputs gathered back in order."""
        elements, count = _elements(step, values)
        announced.spread(step.index, self.dispatcher.batcher_of(step.model_name), count)
        results: list[dict[str, Tensor]] = [{} for _ in range(count)]
        element_step = replace(step, for_each=())

        async def element(i: int) -> None:
            own = {**values, **{name: parts[i] for name, parts in elements.items()}}
            results[i] = await self.call_step(element_step, own, request, deadline, metadata, announced)

        try:
            if count:
                # NOTE: one element failing cancels the others: no call outlives the request.
                async with asyncio.TaskGroup() as group:
                    for i in range(count):
                        group.create_task(element(i))
        except BaseExceptionGroup as failure:
            raise _first_error(failure) from None
        finally:
            announced.withdraw(step.index)  # elements cancelled before they were queued
        return _gathered(step, results, self.registry.signatures.get(step.model_name))


def _elements(step: PlanStep, values: Mapping[str, Tensor]) -> tuple[dict[str, list[Tensor]], int]:
    """A fan-out step's `for_each` tensors split into their elements, and how many each has (all alike,
    else `InvalidInput`)."""
    elements = {name: split(values[name], step.label) for name in step.for_each}
    counts = {name: len(parts) for name, parts in elements.items()}
    if len(set(counts.values())) > 1:
        lengths = ", ".join(f"'{name}' {count}" for name, count in counts.items())
        raise InvalidInput(
            f"{step.label}: its for_each tensors differ in length ({lengths}); each element is one call"
        )
    return elements, next(iter(counts.values()))


def _gathered(
    step: PlanStep, results: Sequence[Mapping[str, Tensor]], signature: ModelSignature | None
) -> dict[str, Tensor]:
    """A fan-out step's outputs: each element's (`results`, in order) gathered into one tensor, as the
    model's `signature` declares its outputs."""
    specs = {spec.name: spec for spec in signature.outputs} if signature is not None else {}
    return {
        tensor_name: gather(
            tensor_name,
            [result[tensor_name] for result in results],
            specs.get(stage_tensor),
            step.label,
        )
        for stage_tensor, tensor_name in step.outputs
    }


def _check_first_response(
    plan: EnsemblePlan,
    step: PlanStep,
    signatures: Mapping[str, ModelSignature],
    values: Mapping[str, Tensor],
    outputs: Mapping[str, Tensor],
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
        signatures[step.model_name],
        inputs=tuple(spec(stage_tensor, values[name]) for stage_tensor, name in step.inputs),
        outputs=tuple(spec(stage_tensor, outputs[name]) for stage_tensor, name in step.outputs),
    )
    try:
        check_signatures(plan, {**signatures, step.model_name: learnt})
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

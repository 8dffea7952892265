"""How the router calls a stage model: the one call (`StageDispatcher.infer` for a client's request,
`StageDispatcher.call_step` for an ensemble's step) that sends it to the stage as it is, or queues it in the
model's batcher (`pipeline.router.scheduling.stage_batchers`) where the model has one.

An unbatched call sends one request to the stage as it is, and counts it: the model's statistics (one
execution, taking the request whole), its span, the compute-duration and batch-size metrics, and the version
that answered. A batched one is counted by its batcher. The dispatcher also says which calls are on their
way to a batcher, so that under load a partial batch may wait for them (`DynamicBatcher.expect`): an
ensemble's later steps (`Announcement`) and the calls that stage models make (`BlsForecast`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from opentelemetry.trace import SpanKind

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import EnsemblePlan, PlanStep
from pipeline.protocol.call_chain import CALL_CHAIN_HEADER, ROOT, CallChain
from pipeline.protocol.codec import (
    Tensor,
    infer_response,
    request_tensors,
    requested_outputs,
    response_tensors,
    validate_inputs,
)
from pipeline.protocol.errors import DeadlineExceeded, StageError
from pipeline.protocol.sequences import copy_sequence
from pipeline.router.caching.cache_policy import ResponseCaching
from pipeline.router.registry import ModelRegistry, batch_items
from pipeline.router.scheduling.batching import DynamicBatcher
from pipeline.router.scheduling.bls_forecast import BlsForecast
from pipeline.router.scheduling.merge import BatchMember
from pipeline.router.scheduling.stage_batchers import StageBatchers
from pipeline.router.stages.stage_client import StageClient
from pipeline.runtime.data_plane import RequestContext
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.telemetry import MODEL, PEER, STAGE, Telemetry


class StageDispatcher:
    """Calls the stage models, unbatched or through their batchers (its own, `batching`), and counts every
    call.

    The signatures and statistics are the `registry`'s; `caching` hears which version answered each call."""

    def __init__(
        self, registry: ModelRegistry, caching: ResponseCaching, *, telemetry: Telemetry, metrics: Metrics
    ) -> None:
        self.registry = registry
        self.caching = caching
        self.telemetry = telemetry
        self.metrics = metrics
        #: The batched stage models' batchers.
        self.batching = StageBatchers(registry, caching, telemetry=telemetry, metrics=metrics)
        self.forecast = BlsForecast(self.batching.batchers)

    # --- a client's request for a stage model --------------------------------------------------------

    async def infer(
        self, client: StageClient, request: pb.ModelInferRequest, call: RequestContext
    ) -> pb.ModelInferResponse:
        """A client's request for a stage model: queued like the ensembles' calls where the model has a
        batcher, else sent to its stage (`client`'s) as it came."""
        name = request.model_name
        batched = self.batching.batchers.get(name)
        if batched is None:
            what = f"model '{name}'"
            return await self._call(client, request, timeout=call.timeout, metadata=call.metadata, what=what)
        signature = self.registry.signatures[name]
        inputs = validate_inputs(
            name, request_tensors(request), signature.inputs, batched[0].config.max_batch_size
        )
        wanted = requested_outputs(request, signature.outputs, name)
        deadline = None if call.timeout is None else time.monotonic() + call.timeout
        chain = CallChain.of(call.metadata)
        stage_call = BatchMember(inputs, tuple(wanted), request.model_version, deadline, chain, call.requests)
        outputs = await self.batching.submit(
            name,
            stage_call,
            deadline,
            request.parameters,
            self.telemetry.current_span(),
            expected=self.forecast.take(chain, name),
        )
        # The version that answered: the one asked, else the default one the stage answered the batch with.
        version = request.model_version or self.caching.default_versions.get(name, "")
        return infer_response(name, version, request.id, (outputs[n] for n in wanted))

    # --- an ensemble's step --------------------------------------------------------------------------

    def announce(self, plan: EnsemblePlan) -> Announcement:
        """A request for `plan` begins: announced to the batcher of each of its batched steps."""
        batchers = self.batching.batchers
        if not batchers:
            return Announcement()
        return Announcement(
            {step.index: batchers[step.model_name][0] for step in plan.steps if step.model_name in batchers}
        )

    def batcher_of(self, model: str) -> DynamicBatcher[Any, Any] | None:
        """The batcher of `model` (None: its calls are not batched)."""
        batched = self.batching.batchers.get(model)
        return batched[0] if batched is not None else None

    async def call_step(
        self,
        client: StageClient,
        step: PlanStep,
        inputs: dict[str, Tensor],
        request: pb.ModelInferRequest,
        deadline: float | None,
        metadata: Sequence[tuple[str, str | bytes]],
        announced: Announcement,
        requests: int = 1,
    ) -> dict[str, Tensor]:
        """One step's call of its model on `client`'s stage, with `inputs` (by the model's tensor names): its
        outputs by the model's names. Queued in the model's batcher (taking up the request's announcement
        there) where it has one, else one stage call that carries the request's sequence. `requests`: how
        many clients' requests it carries (merged by the compiled front)."""
        if step.model_name not in self.batching.batchers:
            return await self._call_unbatched(client, step, inputs, request, deadline, metadata)
        stage_call = BatchMember(
            inputs,
            tuple(stage_tensor for stage_tensor, _ in step.outputs),
            step.model_version,
            deadline,
            CallChain.of(metadata),
            requests,
        )
        try:
            return await self.batching.submit(
                step.model_name,
                stage_call,
                deadline,
                request.parameters,
                self.telemetry.current_span(),
                expected=announced.take(step.index),
            )
        except StageError as err:
            raise StageError(f"{step.label}: {err.message}", err.code, items=err.items) from None

    async def _call_unbatched(
        self,
        client: StageClient,
        step: PlanStep,
        inputs: Mapping[str, Tensor],
        request: pb.ModelInferRequest,
        deadline: float | None,
        metadata: Sequence[tuple[str, str | bytes]],
    ) -> dict[str, Tensor]:
        """One request, one stage call: the step's model has no batcher. The step gets the request's sequence
        (its correlation id and flags), as Triton gives it to every step of an ensemble."""
        stage_request = pb.ModelInferRequest(
            model_name=step.model_name, model_version=step.model_version, id=request.id
        )
        copy_sequence(request, stage_request)
        for stage_tensor, tensor in inputs.items():
            stage_request.inputs.add(name=stage_tensor, datatype=tensor.datatype, shape=tensor.shape)
            stage_request.raw_input_contents.append(tensor.raw)
        for stage_tensor, _ in step.outputs:
            stage_request.outputs.add(name=stage_tensor)
        timeout = None
        if deadline is not None:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise DeadlineExceeded(f"deadline exceeded before {step.label}")
        response = await self._call(
            client, stage_request, timeout=timeout, metadata=metadata, what=step.label
        )
        return response_tensors(response)

    # --- one request, one stage call -----------------------------------------------------------------

    async def _call(
        self,
        client: StageClient,
        request: pb.ModelInferRequest,
        *,
        timeout: float | None,
        metadata: Sequence[tuple[str, str | bytes]],
        what: str,
    ) -> pb.ModelInferResponse:
        """Send one request to its stage model unbatched, and count it; `what` names the step or model in
        errors. The call's span (with tracing on) sends its context to the stage in the metadata."""
        model = request.model_name
        stats = self.registry.stats.get(model)
        first = request.inputs[0].shape if request.inputs else ()
        items = batch_items(self.registry.signatures.get(model), first)
        # The calls the model makes come back with the request's origin (`pipeline.router.scheduling.bls_forecast`).
        origin = self.forecast.begin(model)
        chain = CallChain.of(metadata) or ROOT
        metadata = [
            *(item for item in metadata if item[0] != CALL_CHAIN_HEADER),
            (CALL_CHAIN_HEADER, replace(chain, origin=origin).header()),
        ]
        started = time.perf_counter_ns()
        try:
            if self.telemetry.enabled:
                with self._span(model, client):
                    response = await client.call(
                        "ModelInfer",
                        request,
                        timeout=timeout,
                        metadata=self.telemetry.inject(metadata),
                        what=what,
                    )
            else:
                response = await client.call(
                    "ModelInfer", request, timeout=timeout, metadata=metadata, what=what
                )
        except BaseException:
            if stats is not None:
                stats.request_failed(time.perf_counter_ns() - started)
            raise
        finally:
            self.forecast.end(origin)
        elapsed = time.perf_counter_ns() - started
        if stats is not None:
            # NOTE: an unbatched call executes once per request, taking it whole.
            stats.request_done(items=items, total_ns=elapsed, compute_ns=elapsed)
            stats.batch_done(items, elapsed)
        self.metrics.compute_duration.labels(model).observe(elapsed / 1e9)
        self.metrics.batch_size.labels(model).observe(items)
        self.caching.observe_version(model, request.model_version, response.model_version)
        return response

    def _span(self, model: str, client: StageClient):
        """The span of one unbatched stage call."""
        return self.telemetry.span(
            f"ModelInfer {model}",
            {MODEL: model, STAGE: client.endpoint.name, PEER: client.endpoint.address},
            kind=SpanKind.CLIENT,
        )

    async def close(self) -> None:
        """Stop every batcher (queued requests fail)."""
        await self.batching.close()


class Announcement:
    """The batched steps that one ensemble request was announced to (`DynamicBatcher.expect`), so that under
    load a partial batch may wait for it (`BatchingConfig.batch_upcoming`): each announcement is taken up as
    the step's call is queued (`take`), or taken back where the call does not come (`withdraw`, `release`).
    A fan-out step's one announcement becomes one per element (`spread`)."""

    __slots__ = ("_waiting",)

    def __init__(self, batchers: Mapping[int, DynamicBatcher[Any, Any]] | None = None) -> None:
        """`batchers`: the batcher of each batched step, by step index; each is told now."""
        #: Step index -> its batcher and the calls announced there and not queued yet.
        self._waiting: dict[int, tuple[DynamicBatcher[Any, Any], int]] = {}
        if batchers:
            for index, batcher in batchers.items():
                batcher.expect()
                self._waiting[index] = (batcher, 1)

    def take(self, index: int) -> bool:
        """Whether a call of step `index` being queued now was announced (it is taken up)."""
        entry = self._waiting.get(index)
        if entry is None:
            return False
        batcher, count = entry
        if count > 1:
            self._waiting[index] = (batcher, count - 1)
        else:
            del self._waiting[index]
        return True

    def withdraw(self, index: int) -> None:
        """Step `index` will not call (any more): what was announced there is taken back, so that its batch
        need not wait for it."""
        entry = self._waiting.pop(index, None)
        if entry is not None:
            batcher, count = entry
            for _ in range(count):
                batcher.unexpect()

    def spread(self, index: int, batcher: DynamicBatcher[Any, Any] | None, count: int) -> None:
        """A fan-out step of `count` elements: the request's announcement to the step's `batcher` (None:
        not batched) becomes one per element, all made before any element is queued, so that an idle stage
        waits for the whole request's elements (as far as `batch_upcoming` waits) instead of sending the
        first alone."""
        if batcher is None or count == 0:
            self.withdraw(index)
            return
        _, announced = self._waiting.get(index, (batcher, 0))
        for _ in range(count - announced):
            batcher.expect()
        self._waiting[index] = (batcher, count)

    def release(self) -> None:
        """The request is done: every announcement it did not take up is taken back."""
        for index in list(self._waiting):
            self.withdraw(index)

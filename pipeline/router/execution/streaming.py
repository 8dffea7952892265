"""Ensembles with a decoupled step: every response of that step runs the steps after it and reaches the
client as a response of its own.

The steps the decoupled step does not feed run once, before it, as in `pipeline.router.execution.executor`. Its
responses then come from its stage in order (`StageClient.stream`: a call of their own per request, with
its own flow control), and each runs the steps downstream of it on the values it carries, through their
ordinary batchers, so the responses of many concurrent streams share a downstream step's batches. The
client gets them in the order the decoupled step made them, the last marked final; an error in one response
(the model's, or a downstream step's) is an error response in its place, and the stream goes on.

Memory stays bounded under a slow client: a request holds at most `STREAM_DEPTH` responses between the
decoupled step and its client, and `max_inflight_requests` (Triton's `ensemble_scheduling` field) bounds
what the downstream steps hold across all the ensemble's requests. The decoupled step's next response is
read only when there is room, and a response is let go once the client has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Mapping, Sequence

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import EnsemblePlan, PlanStep
from pipeline.protocol.codec import (
    Tensor,
    infer_response,
    request_tensors,
    requested_outputs,
    response_tensors,
    validate_inputs,
)
from pipeline.protocol.errors import DeadlineExceeded, PipelineError
from pipeline.protocol.streams import error_response, is_final, set_final, status_of
from pipeline.router.execution.branches import skip_reason
from pipeline.router.execution.executor import Executor
from pipeline.router.registry import ENSEMBLE_VERSION
from pipeline.router.scheduling.dispatch import Announcement
from pipeline.runtime.data_plane import RequestContext
from pipeline.runtime.error_status import rpc_status_of
from pipeline.runtime.model_statistics import ModelStats

#: Responses of one request held between the decoupled step and the client (running downstream or done).
STREAM_DEPTH = 16

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class EnsembleStreams:
    """Runs the requests of ensembles that have a decoupled step, on the executor's steps and stages."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        #: Per ensemble with `max_inflight_requests`: the slots its downstream responses take.
        self._slots: dict[str, asyncio.Semaphore] = {}

    def source(self, plan: EnsemblePlan) -> PlanStep | None:
        """The ensemble's first decoupled step (in the plan's order), or None."""
        signatures = self.executor.registry.signatures
        return next((s for s in plan.steps if (sig := signatures.get(s.model_name)) and sig.decoupled), None)

    async def stream(
        self, plan: EnsemblePlan, request: pb.ModelInferRequest, call: RequestContext
    ) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
        """One request for an ensemble with a decoupled step: its responses in order, the last final."""
        source = self.source(plan)
        assert source is not None, f"ensemble '{plan.name}' has no decoupled step"
        started = time.perf_counter_ns()
        stats = self.executor.registry.stats.get(plan.name)
        try:
            async with contextlib.aclosing(self._stream(plan, source, request, call)) as replies:
                index, since = 0, started
                async for reply in replies:
                    if stats is not None:
                        since = _count_response(stats, index, since, reply)
                    index += 1
                    yield reply
        except BaseException:
            if stats is not None:
                stats.request_failed(time.perf_counter_ns() - started)
            raise
        if stats is not None:
            elapsed = time.perf_counter_ns() - started
            stats.request_done(items=1, total_ns=elapsed, compute_ns=elapsed)
            stats.batch_done(1, elapsed)

    async def _stream(
        self, plan: EnsemblePlan, source: PlanStep, request: pb.ModelInferRequest, call: RequestContext
    ) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
        inputs = validate_inputs(plan.name, request_tensors(request), plan.inputs, plan.max_batch_size)
        wanted = requested_outputs(request, plan.outputs, plan.name)
        deadline = None if call.timeout is None else time.monotonic() + call.timeout
        downstream = _downstream(plan, source)
        values: dict[str, Tensor] = dict(inputs)
        for step in plan.steps:
            if step is not source and step not in downstream:
                await self._run_step(plan, step, values, request, deadline, call)
        if skip_reason(plan, source, values):
            # The decoupled step does not run for this request: its one response is what the others made.
            yield set_final(self._response(plan, request, values, wanted), True)
            return
        limit = plan.max_inflight_requests
        slots = self._slots.setdefault(plan.name, asyncio.Semaphore(limit)) if limit else None
        held = _Held(slots)
        reader = asyncio.create_task(
            self._read(plan, source, downstream, values, wanted, request, deadline, call, held)
        )
        try:
            while (item := await held.queue.get()) is not None:
                task, final = item
                try:
                    reply = await task
                finally:
                    held.release()
                yield set_final(reply, final)
            await reader  # raises what made the decoupled step fail
        finally:
            reader.cancel()
            held.clear()

    async def _read(
        self,
        plan: EnsemblePlan,
        source: PlanStep,
        downstream: Sequence[PlanStep],
        values: Mapping[str, Tensor],
        wanted: Sequence[str],
        request: pb.ModelInferRequest,
        deadline: float | None,
        call: RequestContext,
        held: _Held,
    ) -> None:
        """Read the decoupled step's responses, start the downstream steps of each, and queue them in order."""
        executor = self.executor
        client = executor.clients[source.stage]
        stage_request = pb.ModelInferRequest(
            model_name=source.model_name, model_version=source.model_version, id=request.id
        )
        for stage_tensor, tensor_name in source.inputs:
            tensor = values[tensor_name]
            stage_request.inputs.add(name=stage_tensor, datatype=tensor.datatype, shape=tensor.shape)
            stage_request.raw_input_contents.append(tensor.raw)
        for stage_tensor, _ in source.outputs:
            stage_request.outputs.add(name=stage_tensor)
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded(f"deadline exceeded before {source.label}")
        metadata = executor.telemetry.inject(call.metadata)
        responses = client.stream(stage_request, timeout=timeout, metadata=metadata, what=source.label)
        try:
            last_final = False
            async with contextlib.aclosing(responses):
                async for reply in responses:
                    final = is_final(reply)
                    if not reply.error_message and final and not reply.infer_response.outputs:
                        break  # the final flag alone: the client gets it once every response before it
                    await held.reserve()
                    task = asyncio.create_task(
                        self._respond(
                            plan, source, downstream, values, wanted, request, deadline, call, reply
                        )
                    )
                    held.queue.put_nowait((task, final))
                    last_final = final
                    if final:
                        break
            if not last_final:
                await held.reserve()
                held.queue.put_nowait((_done(self._response(plan, request, {}, ())), True))
        finally:
            held.queue.put_nowait(None)

    async def _respond(
        self,
        plan: EnsemblePlan,
        source: PlanStep,
        downstream: Sequence[PlanStep],
        values: Mapping[str, Tensor],
        wanted: Sequence[str],
        request: pb.ModelInferRequest,
        deadline: float | None,
        call: RequestContext,
        reply: pb.ModelStreamInferResponse,
    ) -> pb.ModelStreamInferResponse:
        """One response of the decoupled step through the steps after it: the client's response for it."""
        if reply.error_message:
            status = status_of(reply)
            code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
            return error_response(request, code, f"{source.label}: {status.message}", None)
        own = dict(values)
        produced = response_tensors(reply.infer_response)
        try:
            for stage_tensor, tensor_name in source.outputs:
                tensor = produced.get(stage_tensor)
                if tensor is not None:
                    own[tensor_name] = Tensor(tensor_name, tensor.datatype, tensor.shape, tensor.raw)
            for step in downstream:
                await self._run_step(plan, step, own, request, deadline, call)
        except PipelineError as err:
            return error_response(request, err.code, err.message, rpc_status_of(err))
        return self._response(plan, request, own, wanted)

    async def _run_step(
        self,
        plan: EnsemblePlan,
        step: PlanStep,
        values: dict[str, Tensor],
        request: pb.ModelInferRequest,
        deadline: float | None,
        call: RequestContext,
    ) -> None:
        """Run one step on `values` (unless the request skips it) and add what it produced."""
        executor = self.executor
        if skip_reason(plan, step, values):
            return
        outputs = await executor.call_step(step, values, request, deadline, call.metadata, Announcement())
        values.update(outputs)

    @staticmethod
    def _response(
        plan: EnsemblePlan, request: pb.ModelInferRequest, values: Mapping[str, Tensor], wanted: Sequence[str]
    ) -> pb.ModelStreamInferResponse:
        response = infer_response(
            plan.name, ENSEMBLE_VERSION, request.id, (values[name] for name in wanted if name in values)
        )
        return pb.ModelStreamInferResponse(infer_response=response)


class _Held:
    """The responses of one request between the decoupled step and the client, in order: at most
    `STREAM_DEPTH` of them, each also holding a slot of the ensemble's `max_inflight_requests` (`slots`)."""

    def __init__(self, slots: asyncio.Semaphore | None) -> None:
        self.queue: asyncio.Queue[tuple[asyncio.Task[pb.ModelStreamInferResponse], bool] | None]
        self.queue = asyncio.Queue()
        self._room = asyncio.Semaphore(STREAM_DEPTH)
        self._slots = slots

    async def reserve(self) -> None:
        """Wait for room for one more response."""
        await self._room.acquire()
        if self._slots is not None:
            try:
                await self._slots.acquire()
            except BaseException:
                self._room.release()
                raise

    def release(self) -> None:
        """A response has been taken (by the client, or dropped)."""
        self._room.release()
        if self._slots is not None:
            self._slots.release()

    def clear(self) -> None:
        """Drop the responses still held (the client has gone)."""
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is not None:
                item[0].cancel()
                self.release()


def _downstream(plan: EnsemblePlan, source: PlanStep) -> tuple[PlanStep, ...]:
    """The steps that consume what `source` makes, directly or through others, in the plan's order."""
    fed = {source.index}
    found = []
    for step in plan.steps:
        if any(producer in fed for producer in step.depends_on):
            fed.add(step.index)
            found.append(step)
    return tuple(found)


def _count_response(stats: ModelStats, index: int, since: int, reply: pb.ModelStreamInferResponse) -> int:
    """Count response `index` of a request in the ensemble's `response_stats`, as made in the time since the
    request's start or its previous response (`since`, `perf_counter_ns`); returns now."""
    now = time.perf_counter_ns()
    if reply.error_message:
        stats.response_failed(index, now - since)
    else:
        stats.response_done(index, infer_ns=now - since, empty=not reply.infer_response.outputs)
    return now


def _done(reply: pb.ModelStreamInferResponse) -> asyncio.Task[pb.ModelStreamInferResponse]:
    """A task that has the response already: the final flag alone, queued behind the responses before it."""

    async def ready() -> pb.ModelStreamInferResponse:
        return reply

    return asyncio.ensure_future(ready())

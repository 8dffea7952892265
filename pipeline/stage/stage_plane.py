"""The data plane of every stage service: the models it serves, their versions and instances.

A stage service serves two kinds of models through one `StagePlane`:

- `Stage` objects handed to it in code (in-process servers, tests): one version each per `Stage.versions`,
  one instance, always loaded;
- the entries of a model repository (`pipeline.runtime.repository`) whose backend it runs: each backend
  (`pipeline.stage.backend.Backend`) prepares a version (completed config, unloaded instances) and the plane does
  the rest.

Each served version holds one or more instances (Triton's `instance_group`), each with its own thread, so
inference never blocks the event loop and an instance's calls never overlap; a request takes whichever
instance of its version is idle. Instances that declare themselves `inline` (microseconds of numpy) run on
the event loop instead.

Their lifecycle (loading, reloading with rollback, unloading, and Triton's repository extension) is
`pipeline.stage.model_loading`'s; the plane serves what it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.call_chain import CallChain
from pipeline.protocol.codec import (
    metadata_response,
    request_tensors,
    requested_outputs,
    select_version,
    validate_inputs,
)
from pipeline.protocol.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelNotFound,
    PipelineError,
    Unavailable,
    Unimplemented,
    echo,
)
from pipeline.protocol.sequences import SequenceId, sequence_of
from pipeline.protocol.streams import DECOUPLED_UNARY, set_final
from pipeline.runtime.data_plane import DataPlane, RequestContext
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.telemetry import BATCH_SIZE, Telemetry
from pipeline.stage.api import Deadline, Stage
from pipeline.stage.backend import Backend
from pipeline.stage.bls import BlsScope
from pipeline.stage.control import ModelControl
from pipeline.stage.decoupled import count_stream, stream_replies
from pipeline.stage.encode import stage_response
from pipeline.stage.model_loading import ModelLoading
from pipeline.stage.pool import NOT_STARTED_MESSAGE, Slot
from pipeline.stage.router_link import RouterClient
from pipeline.stage.sequence_batcher import SequenceBatcher
from pipeline.stage.sequence_config import SequenceSettings
from pipeline.stage.sequence_rows import Row, split_rows
from pipeline.stage.served_models import ServedModel, ServedVersion, export_gauges

log = logging.getLogger(__name__)


class StagePlane(DataPlane):
    """Serves `Stage` objects and the repository entries its backends run (see the module docstring)."""

    def __init__(
        self,
        stages: Sequence[Stage] = (),
        *,
        repository: ModelRepository | None = None,
        backends: Sequence[Backend] = (),
        models: Sequence[str] | None = None,
        own: Sequence[str] | None = None,
        telemetry: Telemetry | None = None,
        metrics: Metrics | None = None,
        control: ModelControl | None = None,
        router: RouterClient | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`models` limits the repository models loaded at start-up to those named (Triton's `--load-model`),
        `own` names those the service runs, loaded at start-up or not (default: `models`); `control`
        says whether `RepositoryModelLoad`/`Unload` may run (by default they are refused) and caps the
        instances of every repository model. `router` is where the models' calls to other models go
        (`pipeline.stage.bls`). `clock` times the calls' deadlines (a test may give its own)."""
        self.repository = repository
        self.router = router
        self.clock = clock
        self.loading = ModelLoading(
            stages,
            repository=repository,
            backends=backends,
            models=models,
            control=control or ModelControl(),
            sequences=self._sequence_batcher,
            own=own,
        )
        self._models = self.loading.models
        #: The models that answer on streams only.
        self.decoupled = self.loading.decoupled
        self._started = False
        if repository is not None:
            self.extensions = (*DataPlane.extensions, "model_repository")
        self.telemetry = telemetry or Telemetry()
        self.metrics = metrics or Metrics()
        export_gauges(self.metrics, self._models)

    @property
    def model_names(self) -> list[str]:
        """Every model this plane knows, loaded or not."""
        return list(self._models)

    # ---- loading and unloading (`pipeline.stage.model_loading`) ----------------------------------------------

    async def load(self) -> None:
        """Load every `Stage` object, then every repository model this service runs."""
        await self.loading.load()
        self._started = True

    async def unload(self) -> None:
        await self.loading.unload()

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        return await self.loading.repository_index(ready_only)

    async def repository_load(
        self, name: str, parameters: Mapping[str, object], call: RequestContext
    ) -> None:
        await self.loading.repository_load(name, parameters)

    async def repository_unload(
        self, name: str, parameters: Mapping[str, object], call: RequestContext
    ) -> None:
        await self.loading.repository_unload(name, parameters)

    def _sequence_batcher(self, served: ServedVersion, settings: SequenceSettings) -> SequenceBatcher:
        """The sequence batcher of a version: it runs its batches on the version's instances, and counts
        each batch in the model's statistics and metrics."""
        name = served.name
        stats = self._models[name].stats
        batch_size = self.metrics.batch_size.labels(name)

        def observe(rows: int, compute_ns: int) -> None:
            stats.batch_done(rows, compute_ns)
            batch_size.observe(rows)

        async def run(
            index: int, merged: dict[str, np.ndarray], rows: list[Row], deadline: Deadline
        ) -> tuple[list[dict[str, np.ndarray] | PipelineError], int]:
            slot = served.pool.slots[index]
            instance = slot.instance
            # The calls its model makes go where a stateless model's go (`pipeline.stage.bls`).
            scope = BlsScope(self.router, deadline, None, slot.key, self.telemetry.enabled)
            each = getattr(instance, "run_requests", None)
            try:
                if each is not None:  # a Triton Python model: one request per row, as Triton hands them
                    results, begun, ended = await slot.call(_timed, slot, scope, each, rows, deadline)
                else:
                    run_batch = instance.run
                    outputs, begun, ended = await slot.call(_timed, slot, scope, run_batch, merged, deadline)
                    results = split_rows(outputs, len(rows), settings.batching)
            except asyncio.CancelledError:
                scope.cancel()
                raise
            return results, ended - begun

        return SequenceBatcher(name, settings, len(served.pool.slots), run, observe=observe)

    # ---- serving ---------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        return self._started

    def _get(self, name: str, version: str) -> ServedVersion:
        model = self._models.get(name)
        if model is None:
            raise ModelNotFound(
                f"unknown model '{echo(name)}' (served here: {echo(', '.join(self._models) or 'none', 1000)})"
            )
        if not model.versions:
            raise Unavailable(f"model '{name}' is not loaded ({model.reason or 'loading'})")
        return model.versions[select_version(name, list(model.versions), version)]

    async def model_ready(self, name: str, version: str) -> bool:
        try:
            self._get(name, version)
        except PipelineError:
            return False
        return True

    async def model_metadata(self, name: str, version: str, call: RequestContext) -> pb.ModelMetadataResponse:
        served = self._get(name, version)
        versions = list(self._models[name].versions)
        return metadata_response(name, versions, served.platform, served.inputs, served.outputs)

    async def model_config(self, name: str, version: str, call: RequestContext) -> mc.ModelConfig:
        config = mc.ModelConfig()
        config.CopyFrom(self._get(name, version).config)
        return config

    async def infer(self, request: pb.ModelInferRequest, call: RequestContext) -> pb.ModelInferResponse:
        started = time.perf_counter_ns()
        deadline = Deadline.after(call.timeout, self.clock)
        served = self._get(request.model_name, request.model_version)
        if served.decoupled:
            raise Unimplemented(DECOUPLED_UNARY.format(model=served.name))
        name, version = served.name, served.version
        stats = self._models[name].stats
        telemetry = self.telemetry
        try:
            tensors = validate_inputs(name, request_tensors(request), served.inputs, served.max_batch_size)
            wanted = requested_outputs(request, served.outputs, name)
            arrays = {tensor_name: tensor.to_array() for tensor_name, tensor in tensors.items()}
            batch = next(iter(arrays.values())).shape[0] if served.max_batch_size > 0 and arrays else None
            items = batch or 1
            sequence = self._sequence(served, request, batch)
            decoded = time.perf_counter_ns()
            if telemetry.enabled:
                span = telemetry.current_span()
                if span is not None:
                    span.set_attribute(BATCH_SIZE, items)
            chain = CallChain.of(call.metadata) if call.metadata else None
            result, queue_ns, compute_ns, wall = await self._execute(
                served, arrays, deadline, chain, sequence
            )
            if telemetry.enabled:
                # NOTE: the request's span has the model and the batch size; decoding and encoding are
                # the time before and after this span (each span costs every traced request its export).
                telemetry.record_span("compute", wall[0], wall[1])
            encoding = time.perf_counter_ns()
            response = stage_response(name, version, request.id, wanted, result, served.output_specs, batch)
        except BaseException:
            stats.request_failed(time.perf_counter_ns() - started)
            raise
        finished = time.perf_counter_ns()
        if sequence is None:  # a sequence batcher counts its own batches
            stats.batch_done(items, compute_ns)
        stats.request_done(
            items=items,
            total_ns=finished - started,
            queue_ns=queue_ns,
            compute_ns=compute_ns,
            input_ns=decoded - started,
            output_ns=finished - encoding,
        )
        metrics = self.metrics
        metrics.queue_duration.labels(name).observe(queue_ns / 1e9)
        metrics.compute_duration.labels(name).observe(compute_ns / 1e9)
        if sequence is None:
            metrics.batch_size.labels(name).observe(items)
        return response

    @staticmethod
    def _sequence(
        served: ServedVersion, request: pb.ModelInferRequest, batch: int | None
    ) -> SequenceId | None:
        """The sequence of a request for a model with a sequence batcher (None for other models), refused as
        Triton refuses it where it names none or carries more than one item."""
        if served.sequences is None:
            return None
        sequence = sequence_of(request)
        if sequence is None:
            raise InvalidInput(
                f"inference request to model '{served.name}' must specify a non-zero or non-empty correlation ID"
            )
        if batch is not None and batch != 1:
            raise InvalidInput(
                f"inference request to model '{served.name}' must specify batch-size 1 due to requirements of "
                "sequence batcher"
            )
        return sequence

    async def _execute(
        self,
        served: ServedVersion,
        arrays: dict[str, np.ndarray],
        deadline: Deadline,
        chain: CallChain | None = None,
        sequence: SequenceId | None = None,
    ) -> tuple[dict[str, np.ndarray], int, int, tuple[int, int]]:
        """Run on an idle instance of the version: the result, the wait and run times (ns), and the run's
        wall-clock start and end (for its span). A call whose deadline passes while it waits for an instance
        is answered DEADLINE_EXCEEDED and never run; one whose caller goes away while it runs has its
        deadline marked, so that a stage checking `expired()` stops early, and the calls its model made to
        other models cancelled. `chain`: the chain of model calls the request belongs to, if a model made
        it; such a request goes ahead of clients' requests where the version's own instances wait on it, and
        is refused at once where every instance waits on it or on requests like it (`InstancePool.wedged`).
        A request of a `sequence` goes through the version's sequence batcher instead."""
        if served.retired:
            # Replaced between lookup and execution: use what serves that version now, if anything does.
            served = self._get(served.name, served.version)
        model = self._models[served.name]
        # NOTE: counted in flight before the first await, so a version swapped out after `_get` returned it
        # is not unloaded under this request (`_retire` waits for `quiet`).
        served.inflight += 1
        served.quiet.clear()
        model.pending += 1
        submitted = time.perf_counter_ns()
        try:
            if sequence is not None and served.sequences is not None:
                wall_start = time.time_ns()
                result, queue_ns, compute_ns = await served.sequences.infer(sequence, arrays, deadline)
                return result, queue_ns, compute_ns, (wall_start, time.time_ns())
            pool = served.pool
            if chain is not None and pool.wedged(chain):
                raise Unavailable(_wedged(served))
            slot = await pool.take(chain, deadline.remaining())
            scope = None
            try:
                if deadline.expired():
                    raise DeadlineExceeded(NOT_STARTED_MESSAGE)
                scope = BlsScope(self.router, deadline, chain, slot.key, self.telemetry.enabled)
                result, begun, ended, wall_start, wall_end = await slot.execute(arrays, deadline, scope)
            except asyncio.CancelledError:
                deadline.cancelled = True
                if scope is not None:
                    scope.cancel()
                raise
            finally:
                pool.give(slot)
        finally:
            model.pending -= 1
            served.inflight -= 1
            if served.inflight == 0:
                served.quiet.set()
        return result, begun - submitted, ended - begun, (wall_start, wall_end)

    async def stream(
        self, request: pb.ModelInferRequest, call: RequestContext
    ) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
        """A decoupled model's responses to one request as it makes them (`pipeline.stage.decoupled`), the
        last marked final; an error the model sends is a response of its own."""
        served = self._get(request.model_name, request.model_version)
        if not served.decoupled:  # a version of a decoupled model that is not: its one response
            yield set_final(pb.ModelStreamInferResponse(infer_response=await self.infer(request, call)), True)
            return
        deadline = Deadline.after(call.timeout, self.clock)
        chain = CallChain.of(call.metadata) if call.metadata else None
        router, traced = self.router, self.telemetry.enabled

        def scope_of(slot: Slot) -> BlsScope:
            return BlsScope(router, deadline, chain, slot.key, traced)

        async with contextlib.aclosing(
            _stream(served, self._models[served.name], request, deadline, scope_of)
        ) as replies:
            async for reply in replies:
                yield reply

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        names = [name] if name else [n for n, m in self._models.items() if m.versions]
        reply = pb.ModelStatisticsResponse()
        for model in names:
            served = self._get(model, version)
            reply.model_stats.append(self._models[model].stats.proto(model, served.version))
        return reply


def _timed(slot: Slot, scope: BlsScope, work: Callable[..., Any], *args: Any) -> tuple[Any, int, int]:
    """Run `work` on an instance's thread as one of its batches, in `scope`: counted busy, and timed
    (perf-counter ns)."""
    slot.started += 1
    entered = scope.enter()
    begun = time.perf_counter_ns()
    try:
        return work(*args), begun, time.perf_counter_ns()
    finally:
        slot.finished += 1
        BlsScope.leave(entered)


def _wedged(served: ServedVersion) -> str:
    """Why a call made by a model is refused when every instance of its version waits on it, or on calls
    like it (`InstancePool.wedged`): Triton's Python backend waits forever there. UNAVAILABLE, as Triton
    refuses a request its model cannot queue, and not started: another replica may take it."""
    count = len(served.pool.slots)
    return (
        f"model '{served.name}': every instance ({count}) is waiting for this call or for calls like it, "
        "which wait for an instance of the model themselves, so none could ever run it (a model calling "
        "itself with more callers at once than it has instances); give the model more instances "
        "(instance_group count) or call another model"
    )


async def _stream(
    served: ServedVersion,
    model: ServedModel,
    request: pb.ModelInferRequest,
    deadline: Deadline,
    scope_of: Callable[[Slot], BlsScope],
) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
    """One request's responses from a decoupled version, counted in flight and in its statistics."""
    started = time.perf_counter_ns()
    name, version = served.name, served.version
    tensors = validate_inputs(name, request_tensors(request), served.inputs, served.max_batch_size)
    wanted = requested_outputs(request, served.outputs, name)
    arrays = {tensor_name: tensor.to_array() for tensor_name, tensor in tensors.items()}
    batch = next(iter(arrays.values())).shape[0] if served.max_batch_size > 0 and arrays else None
    specs = {spec.name: spec for spec in served.outputs}
    served.inflight += 1
    served.quiet.clear()
    model.pending += 1
    failed = False
    try:
        async for reply in stream_replies(
            served.pool,
            request,
            arrays,
            deadline,
            lambda outputs: stage_response(
                name, version, request.id, wanted, outputs, specs, batch, model_order=True
            ),
            model.stats,
            scope_of,
        ):
            failed = failed or bool(reply.error_message)
            yield reply
    finally:
        model.pending -= 1
        served.inflight -= 1
        if served.inflight == 0:
            served.quiet.set()
        count_stream(model.stats, batch or 1, time.perf_counter_ns() - started, failed)

"""The data plane of every stage service: models, their versions and instances, and their lifecycle.

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

Lifecycle (`RepositoryModelLoad` / `RepositoryModelUnload`, where `pipeline.stage.control` allows them): a
load reads the model's config and version folders again, prepares and loads the versions its policy names
that are new or changed *beside* those serving, runs their `model_warmup` samples on each instance
(`pipeline.stage.warmup`), and only when all of them loaded swaps them in; the versions they replace then
drain (their in-flight requests finish) and unload. A load that fails unloads what it had built and leaves
the serving versions as they were (rollback). At start-up a model that fails to load is reported UNAVAILABLE, with its
reason, by `RepositoryIndex`, `ModelReady` and the log, while every other model serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from pathlib import Path
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
    RepositoryError,
    RepositoryNotFound,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from pipeline.protocol.model_config import tensor_specs
from pipeline.protocol.sequences import SequenceId, sequence_of
from pipeline.protocol.streams import DECOUPLED_UNARY, set_final
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import ModelRepository, RepositoryEntry
from pipeline.runtime.servicer import CallContext, DataPlane
from pipeline.runtime.telemetry import BATCH_SIZE, Telemetry
from pipeline.stage.api import Deadline, Stage
from pipeline.stage.backend import Backend, PreparedVersion, StageInstance, stage_config
from pipeline.stage.bls import CallScope
from pipeline.stage.control import LoadOverride, ModelControl, load_override
from pipeline.stage.decoupled import count_stream, stream_replies
from pipeline.stage.encode import stage_response
from pipeline.stage.pool import NOT_STARTED_MESSAGE, InstancePool, Slot
from pipeline.stage.router_link import RouterCalls
from pipeline.stage.sequence_batcher import Row, SequenceBatcher, split_rows
from pipeline.stage.sequence_config import SequenceSettings
from pipeline.stage.served_models import ServedModel, ServedVersion, export_gauges, index_entries
from pipeline.stage.warmup import warm_up, warmup_samples

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
        telemetry: Telemetry | None = None,
        metrics: Metrics | None = None,
        control: ModelControl | None = None,
        router: RouterCalls | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`models` limits the repository models served to those named (Triton's `--load-model`); `control`
        says whether `RepositoryModelLoad`/`Unload` may run (by default they are refused) and caps the
        instances of every repository model. `router` is where the models' calls to other models go
        (`pipeline.stage.bls`). `clock` times the calls' deadlines (a test may give its own)."""
        names = [stage.name for stage in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage model names must be unique, got {names}")
        self.repository = repository
        self.backends = {name: backend for backend in backends for name in backend.names}
        self._only = set(models) if models is not None else None
        self.control = control or ModelControl()
        self.router = router
        self.clock = clock
        self._stages = list(stages)
        self._models: dict[str, ServedModel] = {name: ServedModel(name, fixed=True) for name in names}
        #: Model -> the folder its file overrides were written to, kept while they serve.
        self._override_folders: dict[str, tempfile.TemporaryDirectory[str]] = {}
        self._lifecycle = asyncio.Lock()
        self._started = False
        if repository is not None:
            self.extensions = (*DataPlane.extensions, "model_repository")
        self.telemetry = telemetry or Telemetry()
        self.metrics = metrics or Metrics()
        self.decoupled: set[str] = set()
        export_gauges(self.metrics, self._models)

    @property
    def model_names(self) -> list[str]:
        """Every model this plane knows, loaded or not."""
        return list(self._models)

    def _wanted_names(self) -> list[str]:
        if self.repository is None:
            return []
        return [n for n in self.repository.names() if self._only is None or n in self._only]

    # ---- loading and unloading -----------------------------------------------------------------------------

    async def load(self) -> None:
        """Load every `Stage` object, then every repository model this service runs. A `Stage` that fails to
        load stops the service; a repository model that fails is reported and the others serve."""
        async with self._lifecycle:
            for stage in self._stages:
                await self._load_stage(stage)
            for name in self._wanted_names():
                try:
                    await self._load_model(name, None, at_startup=True)
                except RepositoryError as exc:
                    log.error("model '%s' is not served: %s", name, exc.message)
        self._started = True

    async def unload(self) -> None:
        async with self._lifecycle:
            for model in self._models.values():
                versions = list(model.versions.values())
                model.versions = {}
                for served in versions:
                    await self._retire(served)

    async def _load_stage(self, stage: Stage) -> None:
        config = stage_config(stage)
        inputs, outputs = tuple(stage.inputs), tuple(stage.outputs)
        pool = InstancePool(
            [Slot(StageInstance(stage, reason="built into this service"), f"stage-{stage.name}")]
        )
        await pool.load()
        model = self._models[stage.name]
        model.versions = {
            v: ServedVersion(stage.name, v, config, inputs, outputs, pool) for v in stage.versions
        }
        self._serving_changed(model)
        model.reason = ""
        log.info("loaded model '%s' (platform %s)", stage.name, stage.platform)

    async def _load_model(
        self,
        name: str,
        override: mc.ModelConfig | None,
        *,
        at_startup: bool = False,
        repository: ModelRepository | None = None,
    ) -> None:
        """Load (or reload) a repository model (from `repository` instead of the service's, for file
        overrides); the caller holds `_lifecycle`."""
        repository = repository or self.repository
        assert repository is not None
        try:
            entry = repository.read(name, override)
        except RepositoryError as exc:
            if at_startup:
                # Unreadable: whose it is cannot be told; report it, but only if it claims to be ours.
                self._models.setdefault(name, ServedModel(name)).reason = exc.message
            raise
        backend = self.backends.get(entry.backend)
        if backend is None:
            if at_startup:
                return  # another service's model
            raise RepositoryError(
                f"model '{name}': its backend '{entry.backend}' is not run by this service (it runs "
                f"{', '.join(self.backends) or 'none'})"
            )
        model = self._models.get(name)
        if model is not None and model.fixed:
            raise RepositoryError(
                f"model '{name}' is built into this service; the repository cannot replace it"
            )
        model = self._models.setdefault(name, ServedModel(name))
        current = model.versions
        fresh: dict[str, ServedVersion] = {}
        try:
            self.control.check_instances(entry.config, entry.source)
            wanted = entry.served_versions()
            for version in wanted:
                fingerprint = entry.fingerprint(version)
                if version in current and current[version].fingerprint == fingerprint:
                    continue
                fresh[version] = await self._load_version(backend, entry, version, fingerprint)
        except BaseException as exc:
            for served in fresh.values():
                await self._retire(served)
            serving = ", ".join(current) or "none"
            if not current:
                model.reason = f"load failed: {exc}"
            if isinstance(exc, RepositoryError):
                raise type(exc)(f"{exc.message} (versions still serving: {serving})") from None
            if isinstance(exc, PipelineError):
                raise RepositoryError(f"{exc.message} (versions still serving: {serving})") from None
            if isinstance(exc, Exception):
                log.exception("model '%s' failed to load", name)
                raise RepositoryError(
                    f"failed to load model '{name}' from {entry.source}: {type(exc).__name__}: {exc} "
                    f"(versions still serving: {serving})"
                ) from exc
            raise
        versions = {v: fresh.get(v) or current[v] for v in wanted}
        retired = [served for v, served in current.items() if versions.get(v) is not served]
        # NOTE: the swap is one assignment on the event loop: a request sees either the old versions or the new.
        model.versions = versions
        self._serving_changed(model)
        model.wanted = True
        model.reason = ""
        if fresh:
            log.info(
                "model '%s': serving version(s) %s (new: %s)", name, ", ".join(versions), ", ".join(fresh)
            )
        for served in retired:
            await self._retire(served)

    async def _load_version(
        self, backend: Backend, entry: RepositoryEntry, version: str, fingerprint: str
    ) -> ServedVersion:
        prepared: PreparedVersion = await asyncio.to_thread(backend.prepare, entry, version)
        config = prepared.config
        config.name = entry.name
        if not prepared.instances:
            raise RepositoryError(f"{entry.source}: version {version} has no instance to run on")
        inputs, outputs = tensor_specs(config, entry.source)
        sequences = (
            SequenceSettings.of(config, entry.source, entry.folder)
            if config.HasField("sequence_batching")
            else None
        )
        samples = warmup_samples(config, inputs, entry.folder, entry.source)
        label = f"{entry.name}-{version}"
        pool = InstancePool(
            [
                Slot(instance, f"model-{label}-{i}", alone=len(prepared.instances) == 1)
                for i, instance in enumerate(prepared.instances)
            ]
        )
        await pool.load()
        try:
            await warm_up(pool, samples, f"model '{entry.name}' version {version}")
        except BaseException:
            await pool.unload()
            raise
        first = prepared.instances[0]
        log.info(
            "model '%s' version %s: %d instance(s) on %s, platform %s (%s)",
            entry.name,
            version,
            len(prepared.instances),
            ", ".join(i.device for i in prepared.instances),
            config.platform or config.backend,
            first.reason,
        )
        served = ServedVersion(entry.name, version, config, inputs, outputs, pool, fingerprint)
        if sequences is not None:
            served.sequences = self._sequence_batcher(served, sequences)
        return served

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
            scope = CallScope(self.router, deadline, None, slot.key, self.telemetry.enabled)
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

    def _serving_changed(self, model: ServedModel) -> None:
        """Keep `decoupled` (the models that answer on streams only) as the versions serving now say."""
        if any(served.decoupled for served in model.versions.values()):
            self.decoupled.add(model.name)
        else:
            self.decoupled.discard(model.name)

    async def _retire(self, served: ServedVersion) -> None:
        """Let a version's in-flight requests finish, then unload its instances, unless a version still
        serving shares them (a `Stage` object's versions do)."""
        if served.retired:
            return
        served.retired = True
        await served.quiet.wait()
        if served.sequences is not None:
            await served.sequences.close()
        model = self._models.get(served.name)
        if model is not None and any(v.pool is served.pool for v in model.versions.values()):
            return
        await served.pool.unload()
        log.info("model '%s' version %s unloaded", served.name, served.version)

    # ---- the repository extension ----------------------------------------------------------------------------

    def _require_repository(self) -> ModelRepository:
        if self.repository is None:
            raise Unimplemented("this server has no model repository")
        return self.repository

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        """Every model version this service serves or would serve, with its state (READY / UNAVAILABLE)
        and why; models of other services' backends are not listed. A service without a repository answers
        UNIMPLEMENTED, as a plain OIP server does."""
        repository = self._require_repository()
        reply = pb.RepositoryIndexResponse()
        on_disk: dict[str, tuple[str, ...]] = {}
        problems: dict[str, str] = {}
        for name in self._wanted_names():
            try:
                entry = repository.read(name)
            except RepositoryError as exc:
                problems[name] = exc.message
                continue
            if entry.backend in self.backends:
                on_disk[name] = entry.versions
        index_entries(reply, on_disk, problems, self._models, ready_only)
        return reply

    async def repository_load(self, name: str, parameters: Mapping[str, object], call: CallContext) -> None:
        """Load or reload a model. Parameter `config`: a `ModelConfig` as JSON (Triton's field names) that
        replaces the model's `config.pbtxt` for this load; `file:<version>/<name>`: the model's files, which
        it is then loaded from alone, as in Triton. Refused unless repository control is enabled
        (`pipeline.stage.control`)."""
        self._require_repository()
        self.control.check_enabled("RepositoryModelLoad")
        override = load_override(parameters)
        async with self._lifecycle:
            if not override.files:
                await self._load_model(name, override.config)
                self._drop_override_folder(name)
                return
            folder = _override_folder(name, override)
            try:
                await self._load_model(name, override.config, repository=ModelRepository(folder.name))
            except BaseException:
                folder.cleanup()
                raise
            self._drop_override_folder(name)
            self._override_folders[name] = folder

    def _drop_override_folder(self, name: str) -> None:
        folder = self._override_folders.pop(name, None)
        if folder is not None:
            folder.cleanup()

    async def repository_unload(self, name: str, parameters: Mapping[str, object], call: CallContext) -> None:
        """Stop serving a model: new requests are refused, in-flight ones finish, then it unloads. Refused
        unless repository control is enabled (`pipeline.stage.control`)."""
        self._require_repository()
        self.control.check_enabled("RepositoryModelUnload")
        async with self._lifecycle:
            model = self._models.get(name)
            if model is None:
                raise RepositoryNotFound(
                    f"unknown model '{name}' (served here: {', '.join(self._models) or 'none'})"
                )
            if model.fixed:
                raise InvalidInput(f"model '{name}' is built into this service; it cannot be unloaded")
            versions = list(model.versions.values())
            model.versions = {}
            self._serving_changed(model)
            model.wanted = False
            model.reason = "unloaded"
            for served in versions:
                await self._retire(served)
            self._drop_override_folder(name)

    # ---- serving ---------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        return self._started

    def _get(self, name: str, version: str) -> ServedVersion:
        model = self._models.get(name)
        if model is None:
            raise ModelNotFound(f"unknown model '{name}' (served here: {', '.join(self._models) or 'none'})")
        if not model.versions:
            raise Unavailable(f"model '{name}' is not loaded ({model.reason or 'loading'})")
        return model.versions[select_version(name, list(model.versions), version)]

    async def model_ready(self, name: str, version: str) -> bool:
        try:
            self._get(name, version)
        except PipelineError:
            return False
        return True

    async def model_metadata(self, name: str, version: str, call: CallContext) -> pb.ModelMetadataResponse:
        served = self._get(name, version)
        versions = list(self._models[name].versions)
        return metadata_response(name, versions, served.platform, served.inputs, served.outputs)

    async def model_config(self, name: str, version: str, call: CallContext) -> mc.ModelConfig:
        config = mc.ModelConfig()
        config.CopyFrom(self._get(name, version).config)
        return config

    async def infer(self, request: pb.ModelInferRequest, call: CallContext) -> pb.ModelInferResponse:
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
        it; it is refused at once when every instance is busy waiting on it (`_check_waits`). A request of a
        `sequence` goes through the version's sequence batcher instead."""
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
            if chain is not None and served.pool.idle.empty():
                _check_waits(served, chain)
            slot = await served.pool.idle.get()
            scope = None
            try:
                if deadline.expired():
                    raise DeadlineExceeded(NOT_STARTED_MESSAGE)
                scope = CallScope(self.router, deadline, chain, slot.key, self.telemetry.enabled)
                result, begun, ended, wall_start, wall_end = await slot.execute(arrays, deadline, scope)
            except asyncio.CancelledError:
                deadline.cancelled = True
                if scope is not None:
                    scope.cancel()
                raise
            finally:
                served.pool.idle.put_nowait(slot)
        finally:
            model.pending -= 1
            served.inflight -= 1
            if served.inflight == 0:
                served.quiet.set()
        return result, begun - submitted, ended - begun, (wall_start, wall_end)

    async def stream(
        self, request: pb.ModelInferRequest, call: CallContext
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

        def scope_of(slot: Slot) -> CallScope:
            return CallScope(router, deadline, chain, slot.key, traced)

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


def _timed(slot: Slot, scope: CallScope, work: Callable[..., Any], *args: Any) -> tuple[Any, int, int]:
    """Run `work` on an instance's thread as one of its batches, in `scope`: counted busy, and timed
    (perf-counter ns)."""
    slot.started += 1
    entered = scope.enter()
    begun = time.perf_counter_ns()
    try:
        return work(*args), begun, time.perf_counter_ns()
    finally:
        slot.finished += 1
        CallScope.leave(entered)


def _check_waits(served: ServedVersion, chain: CallChain) -> None:
    """Refuse a call made by a model when every instance of its version is busy and waits for it: none
    could ever run it (Triton's Python backend waits forever there)."""
    slots = served.pool.slots
    if all(slot.busy and slot.key in chain.waiting for slot in slots):
        raise ResourceExhausted(
            f"model '{served.name}': every instance ({len(slots)}) is waiting for this call, which a model "
            f"made while running on it, so no instance could ever run it; give the model more instances "
            "(instance_group count) or call it on another model"
        )


async def _stream(
    served: ServedVersion,
    model: ServedModel,
    request: pb.ModelInferRequest,
    deadline: Deadline,
    scope_of: Callable[[Slot], CallScope],
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
            lambda outputs: stage_response(name, version, request.id, wanted, outputs, specs, batch),
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


def _override_folder(name: str, override: LoadOverride) -> tempfile.TemporaryDirectory[str]:
    """A repository of one model, `name`, made of `RepositoryModelLoad`'s file overrides (as Triton does,
    the model is loaded from these files alone, with the `config` parameter as its config)."""
    folder = tempfile.TemporaryDirectory(prefix="pipeline-override-")
    root = Path(folder.name) / name
    for relative, content in override.files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    root.mkdir(exist_ok=True)
    return folder

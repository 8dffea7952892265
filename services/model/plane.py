"""The model service's data plane: repository models, their versions and instances, and their lifecycle.

`RepositoryPlane` is a `StagePlane` whose models come from a `ModelRepository`. Each served version holds
one or more instances (Triton's `instance_group`), each with its own runner and its own executor thread, so
inference never blocks the event loop and an instance's calls never overlap; a request takes whichever
instance of its version is idle.

Lifecycle (`RepositoryModelLoad` / `RepositoryModelUnload`): a load reads the model's config and version
folders again, loads the versions its policy names that are new or changed *beside* those serving, and only
when all of them loaded swaps them in; the versions they replace then drain (their in-flight requests
finish) and unload. A load that fails unloads what it had built and leaves the serving versions as they were
(rollback). A client asks for a version with `model_version`; without one it gets the newest served.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import yaml

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.convert import metadata_response, model_config, select_version
from pipeline.errors import ModelNotFound, PipelineError, Unavailable
from pipeline.metrics import Metrics
from pipeline.server import CallContext, StagePlane
from pipeline.stage import TensorSpec
from pipeline.statistics import ModelStats
from pipeline.telemetry import Telemetry
from services.model.backends import Runner, select_runner
from services.model.repository import ModelEntry, ModelRepository, RepositoryError, place_instances

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """The service-wide defaults a model's config may override."""

    backend: str = "auto"
    device: str = "auto"
    torch_threads: int = 1
    engine_cache: str | None = None


class ModelInstance:
    """One instance of one version: a runner and the one thread it runs on.

    `started` and `finished` are written only by the instance's thread (one writer each, no lock).
    """

    def __init__(self, label: str, index: int, runner: Runner) -> None:
        self.index = index
        self.runner = runner
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"model-{label}-{index}")
        self.started = 0
        self.finished = 0


@dataclass(eq=False)
class ServedVersion:
    """A loaded version of a model, shaped like a `Stage` for `StagePlane.infer` (name, tensors, batch)."""

    name: str
    version: str
    entry: ModelEntry
    fingerprint: str
    instances: list[ModelInstance]
    inputs: Sequence[TensorSpec]
    outputs: Sequence[TensorSpec]
    max_batch_size: int
    platform: str
    backend: str
    #: Set while no request is in flight; unloading waits for it.
    quiet: asyncio.Event = field(default_factory=asyncio.Event)
    inflight: int = 0
    retired: bool = False
    idle: asyncio.Queue[ModelInstance] = field(default_factory=asyncio.Queue)

    def __post_init__(self) -> None:
        self.quiet.set()
        for instance in self.instances:
            self.idle.put_nowait(instance)

    def run(self, instance: ModelInstance, arrays: dict[str, np.ndarray]) -> tuple[Any, ...]:
        """On the instance's thread: check, run, and time one batch."""
        instance.started += 1
        wall_start, begun = time.time_ns(), time.perf_counter_ns()
        try:
            check = self.entry.network.check
            if check is not None:
                check(arrays)
            result = instance.runner.run(arrays)
        finally:
            instance.finished += 1
        return result, begun, time.perf_counter_ns(), wall_start, time.time_ns()


class _ModelCounters:
    """`StagePlane`'s per-model load figures over every instance of the served versions."""

    def __init__(self) -> None:
        self.pending = 0
        self.versions: Mapping[str, ServedVersion] = {}

    @property
    def running(self) -> int:
        return sum(i.started - i.finished for v in self.versions.values() for i in v.instances)

    @property
    def waiting(self) -> int:
        return max(0, self.pending - self.running)


@dataclass
class _Model:
    """A model the plane knows: its served versions (newest last) and why it serves none, if so."""

    name: str
    versions: dict[str, ServedVersion] = field(default_factory=dict)
    #: Whether it should serve (False once unloaded by request).
    wanted: bool = True
    reason: str = ""


class RepositoryPlane(StagePlane):
    """Serves every model of a `ModelRepository`, with versions, instances and the repository extension."""

    extensions = ("model_configuration", "statistics", "model_repository")

    def __init__(
        self,
        repository: ModelRepository,
        settings: ServiceSettings | None = None,
        *,
        telemetry: Telemetry | None = None,
        metrics: Metrics | None = None,
        models: Sequence[str] | None = None,
    ) -> None:
        super().__init__([], telemetry=telemetry, metrics=metrics)
        self.repository = repository
        self.settings = settings or ServiceSettings()
        names = list(models) if models is not None else repository.names()
        self._models: dict[str, _Model] = {name: _Model(name) for name in names}
        # `serve_stages` names the models it serves from here.
        self.stages = dict.fromkeys(names)  # type: ignore[assignment]
        self._lifecycle = asyncio.Lock()
        self._started = False
        for name in names:
            self._track(name)

    def _track(self, name: str) -> None:
        self._stats.setdefault(name, ModelStats())
        if name not in self._load:
            self._load[name] = _ModelCounters()  # type: ignore[assignment]

    # ---- loading and unloading ---------------------------------------------------------------------------

    async def load(self) -> None:
        """Load every model's policy versions; the first failure stops the service from starting."""
        async with self._lifecycle:
            for name in self._models:
                await self._load_model(name, None)
        self._started = True

    async def unload(self) -> None:
        async with self._lifecycle:
            for model in self._models.values():
                versions = list(model.versions.values())
                model.versions = {}
                self._loaded.discard(model.name)
                for served in versions:
                    await self._retire(served)

    async def _load_model(self, name: str, override: Mapping[str, Any] | None) -> None:
        entry = self.repository.read(name, override)
        wanted = entry.served_versions()
        model = self._models.setdefault(name, _Model(name))
        self._track(name)
        current = model.versions
        fresh: dict[str, ServedVersion] = {}
        try:
            for version in wanted:
                fingerprint = entry.fingerprint(version)
                if version in current and current[version].fingerprint == fingerprint:
                    continue
                fresh[version] = await self._load_version(entry, version, fingerprint)
        except BaseException as exc:
            for served in fresh.values():
                await self._retire(served)
            serving = ", ".join(current) or "none"
            model.reason = f"load failed: {exc}"
            if isinstance(exc, PipelineError):
                raise RepositoryError(f"{exc.message} (versions still serving: {serving})") from None
            if isinstance(exc, Exception):
                raise RepositoryError(
                    f"failed to load model '{name}': {exc} (versions still serving: {serving})"
                ) from exc
            raise
        versions = {v: fresh.get(v) or current[v] for v in sorted(wanted, key=int)}
        retired = [served for v, served in current.items() if versions.get(v) is not served]
        # NOTE: the swap is one assignment on the event loop: a request sees either the old versions or the new.
        model.versions = versions
        model.wanted = True
        model.reason = ""
        self._load[name].versions = versions  # type: ignore[attr-defined]
        self._loaded.add(name)
        self.stages[name] = None  # type: ignore[assignment]
        if fresh:
            log.info(
                "model '%s': serving version(s) %s (new: %s)", name, ", ".join(versions), ", ".join(fresh)
            )
        for served in retired:
            await self._retire(served)

    async def _load_version(self, entry: ModelEntry, version: str, fingerprint: str) -> ServedVersion:
        config = entry.config
        version_dir = entry.version_dir(version)
        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = place_instances(
            config.instance_group, gpu_count=gpu_count, default_device=self.settings.device
        )
        label = f"{entry.name}:{version}"
        instances = []
        for index, device in enumerate(devices):
            runner = select_runner(
                config.backend or self.settings.backend,
                device,
                network=entry.network,
                version_dir=version_dir,
                precision=config.precision,
                torch_options=config.torch.options(),
                threads=self.settings.torch_threads,
                engine_cache=self.settings.engine_cache,
                max_batch_size=entry.max_batch_size,
                preferred_batch_size=config.preferred_batch_size,
                label=f"{label} instance {index}",
            )
            instances.append(ModelInstance(label, index, runner))
        loop = asyncio.get_running_loop()
        loaded: list[ModelInstance] = []
        try:
            # The first instance alone (it may build and cache a TensorRT engine), then the rest together.
            for batch in (instances[:1], instances[1:]):
                await asyncio.gather(*(loop.run_in_executor(i.executor, i.runner.load) for i in batch))
                loaded += batch
        except BaseException:
            await asyncio.gather(*(loop.run_in_executor(i.executor, i.runner.unload) for i in loaded))
            for instance in instances:
                instance.executor.shutdown(wait=False)
            raise
        first = instances[0].runner
        log.info(
            "model '%s' version %s: %d instance(s) on %s, backend %s (%s)",
            entry.name,
            version,
            len(instances),
            ", ".join(r.runner.device for r in instances),
            first.name,
            first.reason,
        )
        return ServedVersion(
            name=entry.name,
            version=version,
            entry=entry,
            fingerprint=fingerprint,
            instances=instances,
            inputs=entry.network.inputs,
            outputs=entry.network.outputs,
            max_batch_size=entry.max_batch_size,
            platform=first.platform,
            backend=first.name,
        )

    async def _retire(self, served: ServedVersion) -> None:
        """Let a version's in-flight requests finish, then unload its instances."""
        served.retired = True
        await served.quiet.wait()
        loop = asyncio.get_running_loop()
        for instance in served.instances:
            await loop.run_in_executor(instance.executor, instance.runner.unload)
            instance.executor.shutdown(wait=False)
        log.info("model '%s' version %s unloaded", served.name, served.version)

    # ---- the repository extension -------------------------------------------------------------------------

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        """Every model version on disk or serving, with its state (READY / UNAVAILABLE) and why."""
        reply = pb.RepositoryIndexResponse()
        names = sorted(set(self.repository.names()) | set(self._models))
        for name in names:
            model = self._models.get(name)
            served = model.versions if model else {}
            on_disk: tuple[str, ...] = ()
            problem = ""
            try:
                on_disk = self.repository.read(name).versions
            except RepositoryError as exc:
                problem = exc.message
            for version in sorted(set(on_disk) | set(served), key=int):
                if version in served:
                    reply.models.add(name=name, version=version, state="READY")
                elif not ready_only:
                    reason = problem or (model.reason if model and model.reason else "")
                    if not reason:
                        reason = "unloaded" if model and not model.wanted else "not loaded"
                    reply.models.add(name=name, version=version, state="UNAVAILABLE", reason=reason)
            if not on_disk and not served and not ready_only:
                reply.models.add(name=name, state="UNAVAILABLE", reason=problem or "no versions")
        return reply

    async def repository_load(self, name: str, parameters: Mapping[str, Any]) -> None:
        """Load or reload a model (parameter `config`: JSON or YAML keys that win over its config.yaml)."""
        override = None
        if "config" in parameters:
            try:
                override = yaml.safe_load(str(parameters["config"]))
            except yaml.YAMLError as exc:
                raise RepositoryError(f"parameter 'config' is not JSON or YAML: {exc}") from None
            if not isinstance(override, dict):
                raise RepositoryError("parameter 'config' must be a mapping of config.yaml keys")
        async with self._lifecycle:
            await self._load_model(name, override)

    async def repository_unload(self, name: str, parameters: Mapping[str, Any]) -> None:
        """Stop serving a model: new requests are refused, in-flight ones finish, then it unloads."""
        async with self._lifecycle:
            model = self._models.get(name)
            if model is None:
                raise ModelNotFound(f"unknown model '{name}' (served here: {', '.join(self._models)})")
            versions = list(model.versions.values())
            model.versions = {}
            model.wanted = False
            model.reason = "unloaded"
            self._load[name].versions = {}  # type: ignore[attr-defined]
            self._loaded.discard(name)
            for served in versions:
                await self._retire(served)

    # ---- what StagePlane asks of its models ---------------------------------------------------------------

    def ready(self) -> bool:
        return self._started and all(m.versions for m in self._models.values() if m.wanted)

    def _get(self, name: str, version: str) -> tuple[ServedVersion, str]:  # type: ignore[override]
        model = self._models.get(name)
        if model is None:
            raise ModelNotFound(f"unknown model '{name}' (served here: {', '.join(self._models)})")
        if not model.versions:
            raise Unavailable(f"model '{name}' is not loaded ({model.reason or 'loading'})")
        chosen = select_version(name, list(model.versions), version)
        return model.versions[chosen], chosen

    async def model_ready(self, name: str, version: str) -> bool:
        try:
            self._get(name, version)
        except PipelineError:
            return False
        return True

    async def model_metadata(self, name: str, version: str, call: CallContext) -> pb.ModelMetadataResponse:
        served, _ = self._get(name, version)
        versions = list(self._models[name].versions)
        return metadata_response(name, versions, served.platform, served.inputs, served.outputs)

    async def model_config(self, name: str, version: str, call: CallContext) -> mc.ModelConfig:
        served, chosen = self._get(name, version)
        entry = served.entry
        first = served.instances[0].runner
        config = model_config(
            name,
            platform=served.platform,
            backend=served.backend,
            max_batch_size=served.max_batch_size,
            inputs=served.inputs,
            outputs=served.outputs,
            parameters={
                "architecture": entry.config.architecture,
                "precision": first.precision,
                "backend_reason": first.reason,
                "devices": ",".join(i.runner.device for i in served.instances),
                "version": chosen,
            },
        )
        policy = entry.config.version_policy
        if policy.all is not None:
            config.version_policy.all.SetInParent()
        elif policy.specific is not None:
            config.version_policy.specific.versions.extend(policy.specific.versions)
        elif policy.latest is not None:
            config.version_policy.latest.num_versions = policy.latest.num_versions
        if entry.config.preferred_batch_size:
            config.dynamic_batching.preferred_batch_size.append(entry.config.preferred_batch_size)
        by_device: dict[str, int] = {}
        for instance in served.instances:
            by_device[instance.runner.device] = by_device.get(instance.runner.device, 0) + 1
        for index, (device, count) in enumerate(by_device.items()):
            group = config.instance_group.add(name=f"{name}_{index}", count=count)
            if device == "cpu":
                group.kind = mc.ModelInstanceGroup.KIND_CPU
            else:
                group.kind = mc.ModelInstanceGroup.KIND_GPU
                group.gpus.append(int(device.split(":")[1]))
        return config

    async def _execute(  # type: ignore[override]
        self, stage: ServedVersion, arrays: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], int, int, tuple[int, int]]:
        """Run on an idle instance of the version: the result, the wait and run times (ns) and the run's
        wall-clock start and end."""
        if stage.retired:
            # Replaced between lookup and execution: use what serves that version now, if anything does.
            stage, _ = self._get(stage.name, stage.version)
        # NOTE: counted in flight before the first await, so a version swapped out after `_get` returned it
        # is not unloaded under this request (`_retire` waits for `quiet`).
        stage.inflight += 1
        stage.quiet.clear()
        counters = self._load[stage.name]
        counters.pending += 1
        submitted = time.perf_counter_ns()
        try:
            instance = await stage.idle.get()
            try:
                loop = asyncio.get_running_loop()
                result, begun, ended, wall_start, wall_end = await loop.run_in_executor(
                    instance.executor, stage.run, instance, arrays
                )
            finally:
                stage.idle.put_nowait(instance)
        finally:
            counters.pending -= 1
            stage.inflight -= 1
            if stage.inflight == 0:
                stage.quiet.set()
        return result, begun - submitted, ended - begun, (wall_start, wall_end)

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        names = [name] if name else [n for n, m in self._models.items() if m.versions]
        reply = pb.ModelStatisticsResponse()
        for model in names:
            _, chosen = self._get(model, version)
            reply.model_stats.append(self._stats[model].proto(model, chosen))
        return reply

"""The lifecycle of a stage service's models: loading, reloading and unloading them, and Triton's repository
extension (`RepositoryIndex`, `RepositoryModelLoad`, `RepositoryModelUnload`).

A load reads the model's config and version folders again, prepares and loads the versions its policy names
that are new or changed *beside* those serving, runs their `model_warmup` samples on each instance
(`pipeline.stage.warmup`), and only when all of them loaded swaps them in; the versions they replace then
drain (their in-flight requests finish) and unload. A load that fails unloads what it had built and leaves
the serving versions as they were (rollback). At start-up a model that fails to load is reported
UNAVAILABLE, with its reason, while every other model serves. The plane (`pipeline.stage.stage_plane`)
serves what this holds.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import (
    InvalidInput,
    PipelineError,
    RepositoryError,
    RepositoryNotFound,
    Unimplemented,
    echo,
)
from pipeline.protocol.model_config import tensor_specs
from pipeline.runtime.repository import ModelRepository, RepositoryEntry
from pipeline.stage.api import Stage
from pipeline.stage.backend import Backend, PreparedVersion, StageInstance, stage_config
from pipeline.stage.control import LoadOverride, ModelControl, load_override
from pipeline.stage.pool import InstancePool, Slot
from pipeline.stage.sequence_batcher import SequenceBatcher
from pipeline.stage.sequence_config import SequenceSettings
from pipeline.stage.served_models import ServedModel, ServedVersion, index_entries
from pipeline.stage.warmup import warm_up, warmup_samples

log = logging.getLogger(__name__)

#: Makes a version's sequence batcher (the plane's: it runs the batches).
SequencesOf = Callable[[ServedVersion, SequenceSettings], SequenceBatcher]


class ModelLoading:
    """The models one stage service serves, and their loading (see the module docstring)."""

    def __init__(
        self,
        stages: Sequence[Stage],
        *,
        repository: ModelRepository | None,
        backends: Sequence[Backend],
        models: Sequence[str] | None,
        control: ModelControl,
        sequences: SequencesOf,
        own: Collection[str] | None = None,
    ) -> None:
        names = [stage.name for stage in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage model names must be unique, got {names}")
        self.repository = repository
        self.backends = {name: backend for backend in backends for name in backend.names}
        self._only = set(models) if models is not None else None
        self._others = _held_by_others(repository, self._only if own is None else own)
        self.control = control
        self._sequences = sequences
        self._stages = list(stages)
        #: Every model the service knows, loaded or not.
        self.models: dict[str, ServedModel] = {name: ServedModel(name, fixed=True) for name in names}
        #: The models that answer on streams only, as the versions serving now say.
        self.decoupled: set[str] = set()
        #: Model -> the folder its file overrides were written to, kept while they serve.
        self._override_folders: dict[str, tempfile.TemporaryDirectory[str]] = {}
        self._lifecycle = asyncio.Lock()

    def _wanted_names(self) -> list[str]:
        """The repository models this service loads at start-up."""
        names = self.repository.names() if self.repository is not None else []
        return [n for n in names if self._only is None or n in self._only]

    def _listed_names(self) -> list[str]:
        """The repository models its `RepositoryIndex` lists: all but those the repository held at start-up
        for other services, so that a folder added since can be found, and loaded, through the router."""
        names = self.repository.names() if self.repository is not None else []
        return [n for n in names if n not in self._others]

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

    async def unload(self) -> None:
        async with self._lifecycle:
            for model in self.models.values():
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
        model = self.models[stage.name]
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
        found = self._entry(name, override, at_startup, repository or self.repository)
        if found is None:
            return  # another service's model
        entry, backend = found
        model = self.models.setdefault(name, ServedModel(name))
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
            failure = self._failed(model, entry, exc)
            if failure is exc:
                raise
            raise failure from (None if isinstance(exc, PipelineError) else exc)
        self._swap(model, {v: fresh.get(v) or current[v] for v in wanted}, fresh)
        for served in current.values():
            if model.versions.get(served.version) is not served:
                await self._retire(served)

    def _entry(
        self, name: str, override: mc.ModelConfig | None, at_startup: bool, repository: ModelRepository | None
    ) -> tuple[RepositoryEntry, Backend] | None:
        """A model's repository entry and the backend that runs it; None at start-up for another service's
        model. Raises `RepositoryError` where it cannot be read, or cannot be loaded here."""
        assert repository is not None
        try:
            entry = repository.read(name, override)
        except RepositoryError as exc:
            if at_startup:
                # Unreadable: whose it is cannot be told; report it, but only if it claims to be ours.
                self.models.setdefault(name, ServedModel(name)).reason = exc.message
            raise
        backend = self.backends.get(entry.backend)
        if backend is None:
            if at_startup:
                return None
            raise RepositoryError(
                f"model '{name}': its backend '{entry.backend}' is not run by this service (it runs "
                f"{', '.join(self.backends) or 'none'})"
            )
        model = self.models.get(name)
        if model is not None and model.fixed:
            raise RepositoryError(
                f"model '{name}' is built into this service; the repository cannot replace it"
            )
        return entry, backend

    @staticmethod
    def _failed(model: ServedModel, entry: RepositoryEntry, exc: BaseException) -> BaseException:
        """What a load that failed with `exc` raises: a `RepositoryError` that says which versions still
        serve (anything but an `Exception`, a cancellation say, as it is)."""
        serving = ", ".join(model.versions) or "none"
        if not model.versions:
            model.reason = f"load failed: {exc}"
        if isinstance(exc, RepositoryError):
            return type(exc)(f"{exc.message} (versions still serving: {serving})")
        if isinstance(exc, PipelineError):
            return RepositoryError(f"{exc.message} (versions still serving: {serving})")
        if isinstance(exc, Exception):
            log.exception("model '%s' failed to load", model.name)
            return RepositoryError(
                f"failed to load model '{model.name}' from {entry.source}: {type(exc).__name__}: {exc} "
                f"(versions still serving: {serving})"
            )
        return exc

    def _swap(
        self, model: ServedModel, versions: dict[str, ServedVersion], fresh: dict[str, ServedVersion]
    ) -> None:
        """Serve `versions` from now on; those it replaces are retired by the caller."""
        # NOTE: the swap is one assignment on the event loop: a request sees either the old versions or the new.
        model.versions = versions
        self._serving_changed(model)
        model.wanted = True
        model.reason = ""
        if fresh:
            log.info(
                "model '%s': serving version(s) %s (new: %s)",
                model.name,
                ", ".join(versions),
                ", ".join(fresh),
            )

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
            served.sequences = self._sequences(served, sequences)
        return served

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
        model = self.models.get(served.name)
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
        for name in self._listed_names():
            try:
                entry = repository.read(name)
            except RepositoryError as exc:
                problems[name] = exc.message
                continue
            if entry.backend in self.backends:
                on_disk[name] = entry.versions
        index_entries(reply, on_disk, problems, self.models, ready_only)
        return reply

    async def repository_load(self, name: str, parameters: Mapping[str, object]) -> None:
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

    async def repository_unload(self, name: str, parameters: Mapping[str, object]) -> None:
        """Stop serving a model: new requests are refused, in-flight ones finish, then it unloads. Refused
        unless repository control is enabled (`pipeline.stage.control`)."""
        self._require_repository()
        self.control.check_enabled("RepositoryModelUnload")
        async with self._lifecycle:
            model = self.models.get(name)
            if model is None:
                raise RepositoryNotFound(
                    f"unknown model '{echo(name)}' (served here: {echo(', '.join(self.models) or 'none', 1000)})"
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


def _held_by_others(repository: ModelRepository | None, mine: Collection[str] | None) -> frozenset[str]:
    """The folders `repository` holds now that are not this service's (`mine`: its models, loaded at start-up
    or not, `StagePlane`'s `own`; None: all are), but other services' (`pipeline.stage.placement`). A folder
    that appears later is anyone's who runs its backend."""
    if repository is None or mine is None:
        return frozenset()
    return frozenset(n for n in repository.names() if n not in mine)


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

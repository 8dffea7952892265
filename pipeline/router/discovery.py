"""The stages behind the router: which stage serves each model, what their repositories hold, their health.

At start-up the router finds the stage of every step that names none (the first declared stage whose
`RepositoryIndex` lists its model as READY) and learns every stage model's signature from its stage,
waiting for stages that are not up yet. While it serves, it keeps each stage's health current (readiness
follows stages that stop or return), serves the models of the stages' repositories that no ensemble names,
and answers `RepositoryIndex` for them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import types
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import Catalog, EnsemblePlan
from pipeline.ensemble.signatures import check_signatures
from pipeline.protocol.errors import (
    ConfigError,
    ModelNotFound,
    PipelineError,
    StageError,
    Unavailable,
    echo,
)
from pipeline.router.caching import ResponseCaching
from pipeline.router.registry import ENSEMBLE_VERSION, ModelRegistry
from pipeline.router.stage_client import StageClient
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.statistics import ModelStats

log = logging.getLogger(__name__)


#: How long a model served by several stages waits for an earlier declared stage that has not answered or
#: is still loading (it may serve the model too) before the first stage found serving it is used.
SETTLE_S = 30.0


class StageDiscovery:
    """The stages' clients, the stage that serves each model, the stages' repository indexes and health."""

    def __init__(
        self,
        catalog: Catalog,
        clients: Mapping[str, StageClient],
        registry: ModelRegistry,
        caching: ResponseCaching,
        metrics: Metrics | None = None,
    ) -> None:
        """`clients`: stage key -> its client, in the order the stages are declared. The signatures learnt
        go to `registry`; a refreshed repository index tells `caching` which versions are still served."""
        self.catalog = catalog
        self.clients = clients
        self.registry = registry
        self.caching = caching
        self.stage_of_model: dict[str, str] = catalog.stage_models()
        #: The ensembles served, each step's stage found once `discover` has found it.
        self.ensembles: dict[str, EnsemblePlan] = dict(catalog.ensembles)
        #: Models of steps that name no stage, until a stage's `RepositoryIndex` lists them.
        self.unresolved = {
            step.model_name
            for plan in catalog.ensembles.values()
            for step in plan.steps
            if not step.stage and step.model_name not in self.stage_of_model
        }
        #: Stage key -> the models its `RepositoryIndex` lists as READY, with their READY versions; None for
        #: a stage without the RPC.
        self.indexes: dict[str, Mapping[str, frozenset[str]] | None] = {}
        #: Every model of the stages' repositories -> the first declared stage that serves it.
        self.repository_models: dict[str, str] = {}
        self._refreshing: asyncio.Future[None] | None = None
        if metrics is not None:
            self._export_gauges(metrics)

    def _export_gauges(self, metrics: Metrics) -> None:
        clients = self.clients
        metrics.gauge(
            "pipeline_stage_inflight_calls",
            "The router's calls in flight to each replica of a stage",
            ("stage", "replica"),
            lambda: [
                ((key, r.address), r.outstanding)
                for key, c in clients.items()
                for r in c.replicas.by_address.values()
            ],
        )
        metrics.gauge(
            "pipeline_stage_replicas_ready",
            "Replicas of the stage whose health says SERVING",
            "stage",
            lambda: [(key, c.replicas.ready_count) for key, c in clients.items()],
        )
        metrics.gauge(
            "pipeline_stage_healthy",
            "1 when the stage's health check says SERVING",
            "stage",
            lambda: [(key, float(c.replicas.healthy)) for key, c in clients.items()],
        )

    # --- start-up ------------------------------------------------------------------------------------

    async def discover(self, retry_interval: float) -> None:
        """Find the stage of every step that names none, learn every stage model's signature from its
        stage, waiting for stages that are not up yet, then check every ensemble against them (a mismatch
        raises `ConfigError`)."""
        for client in self.clients.values():
            client.start()
        await self._find_stages(retry_interval)
        for model, key in self.stage_of_model.items():
            self.clients[key].replicas.models.add(model)
        await self._learn_signatures(retry_interval)
        for plan in self.ensembles.values():
            check_signatures(plan, self.registry.signatures)

    async def _learn_signatures(self, retry_interval: float) -> None:
        """Ask each stage model's stage for its signature until every one has answered."""
        signatures = self.registry.signatures
        waiting_since = time.monotonic()
        reported: set[str] = set()
        # NOTE: `signatures` may also hold repository models that clients called meanwhile.
        while missing := [model for model in self.stage_of_model if model not in signatures]:
            for model in missing:
                key = self.stage_of_model[model]
                try:
                    signatures[model] = await self.clients[key].signature(model)
                except PipelineError as err:
                    if model not in reported or time.monotonic() - waiting_since > 30:
                        log.info("waiting for model '%s' on stage '%s': %s", model, key, err.message)
                        reported.add(model)
            if any(model not in signatures for model in missing):
                await asyncio.sleep(retry_interval)

    async def wait_serving(self, retry_interval: float) -> None:
        """Wait for every stage's health to say SERVING (metadata answers before a stage has loaded its
        models)."""
        clients = self.clients.values()
        while not all(await asyncio.gather(*(c.replicas.check_health(timeout=2.0) for c in clients))):
            await asyncio.sleep(retry_interval)

    async def _find_stages(self, retry_interval: float) -> None:
        """Give each step that names no stage the stage whose `RepositoryIndex` lists its model as READY
        (the first declared where several do: an earlier stage that has not answered yet or is still loading
        is waited for, up to `SETTLE_S`), waiting for stages that are down or still loading."""
        waiting_since: float | None = None
        started = time.monotonic()
        while True:
            await self.refresh_index()
            for model in sorted(self.unresolved):
                self._find_stage(model, settling=time.monotonic() - started < SETTLE_S)
            if not self.unresolved:
                break
            self._check_findable()
            now = time.monotonic()
            if waiting_since is None or now - waiting_since > 30:
                waiting_since = now
                asked = ", ".join(f"'{key}' ({c.endpoint.address})" for key, c in self.clients.items())
                log.info(
                    "waiting for a stage that serves model(s) %s: no RepositoryIndex of %s lists them as "
                    "READY yet",
                    ", ".join(sorted(self.unresolved)),
                    asked,
                )
            await asyncio.sleep(retry_interval)
        self.ensembles = {name: self._resolved(plan) for name, plan in self.ensembles.items()}

    def _find_stage(self, model: str, *, settling: bool) -> None:
        """The first declared stage that serves `model`, if it is found: a stage declared before that one
        and still loading (not SERVING yet) may list it later, so while `settling`, wait for it."""
        found = [key for key in self.clients if model in (self.indexes.get(key) or ())]
        if not found:
            return
        before = list(self.clients)[: list(self.clients).index(found[0])]
        if settling and any(
            key not in self.indexes
            or (self.indexes[key] is not None and not self.clients[key].replicas.healthy)
            for key in before
        ):
            return
        if len(found) > 1:
            log.info(
                "model '%s' is served by stages %s: using '%s', the first declared",
                model,
                ", ".join(found),
                found[0],
            )
        else:
            log.info("model '%s' is served by stage '%s'", model, found[0])
        self.stage_of_model[model] = found[0]
        self.registry.stats.setdefault(model, ModelStats())
        self.unresolved.discard(model)

    def _check_findable(self) -> None:
        """Raise `ConfigError` where no stage can ever say that it serves the unresolved models."""
        if not self.clients:
            raise ConfigError(
                f"no stage to serve model(s) {', '.join(sorted(self.unresolved))}: a step names no stage "
                "and the router has none (give them with --stage NAME=ADDRESS)"
            )
        if len(self.indexes) == len(self.clients) and all(m is None for m in self.indexes.values()):
            raise ConfigError(
                f"no stage can say whether it serves model(s) {', '.join(sorted(self.unresolved))}: "
                f"none of {', '.join(self.clients)} implements RepositoryIndex; name the stage in the step"
            )

    def _resolved(self, plan: EnsemblePlan) -> EnsemblePlan:
        """`plan` with the stage found for each step that names none."""
        if all(step.stage for step in plan.steps):
            return plan
        steps = tuple(
            step if step.stage else replace(step, stage=self.stage_of_model[step.model_name])
            for step in plan.steps
        )
        stages = {**plan.stages, **{step.stage: self.catalog.stages[step.stage] for step in steps}}
        return replace(plan, steps=steps, stages=types.MappingProxyType(stages))

    # --- repository indexes --------------------------------------------------------------------------

    async def refresh_index(self) -> None:
        """Ask every stage for its `RepositoryIndex` (READY models) now; calls made meanwhile share one."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh_index())
        await asyncio.shield(self._refreshing)

    async def _refresh_index(self) -> None:
        keys = list(self.clients)
        found = await asyncio.gather(*(self._index_of(self.clients[key]) for key in keys))
        for key, models in zip(keys, found, strict=True):
            if not isinstance(models, PipelineError):  # a stage that is down keeps what it said last
                self.indexes[key] = models
        served: dict[str, str] = {}
        for key in keys:
            for model in sorted(self.indexes.get(key) or ()):
                served.setdefault(model, key)
        self.repository_models = served
        self.caching.drop_unserved(self.ready_versions)

    def ready_versions(self, model: str) -> frozenset[str] | None:
        """The versions of `model` that the stage serving it lists as READY; None where it cannot say (no
        stage serves it, or its stage has no `RepositoryIndex` or has not answered yet)."""
        key = self.stage_of_model.get(model) or self.repository_models.get(model)
        index = self.indexes.get(key) if key is not None else None
        return None if index is None else index.get(model, frozenset())

    @staticmethod
    async def _index_of(client: StageClient) -> dict[str, frozenset[str]] | PipelineError | None:
        """The models a stage's `RepositoryIndex` lists as READY, with their READY versions; None for a
        stage without the RPC (a plain OIP server); the error for a stage that cannot answer now."""
        try:
            reply = await client.call(
                "RepositoryIndex",
                pb.RepositoryIndexRequest(ready=True),
                timeout=2.0,
                what="its repository index",
            )
        except StageError as err:
            return None if err.code == grpc.StatusCode.UNIMPLEMENTED else err
        except PipelineError as err:
            return err
        ready: dict[str, set[str]] = {}
        for model in reply.models:
            if model.state == "READY":
                ready.setdefault(model.name, set()).add(model.version)
        return {name: frozenset(versions) for name, versions in ready.items()}

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        """The ensembles, then every stage's models as its own `RepositoryIndex` lists them (a model that
        several stages hold, as the stage that serves it here); a stage without the RPC lists the models
        the ensembles name on it."""
        reply = pb.RepositoryIndexResponse()
        ready = self.ready()
        for name in sorted(self.ensembles):
            if ready:
                reply.models.add(name=name, version=ENSEMBLE_VERSION, state="READY")
            elif not ready_only:
                reply.models.add(
                    name=name, version=ENSEMBLE_VERSION, state="UNAVAILABLE", reason="waiting for its stages"
                )
        keys = list(self.clients)
        answers = await asyncio.gather(
            *(self._stage_index(key, ready_only) for key in keys), return_exceptions=False
        )
        owner: dict[str, str] = {}
        for key, models in zip(keys, answers, strict=True):
            for model in models:
                serving = self.stage_of_model.get(model.name) or owner.setdefault(model.name, key)
                if serving == key and model.name not in self.ensembles:
                    reply.models.append(model)
        return reply

    async def _stage_index(self, key: str, ready_only: bool) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        client = self.clients[key]
        problem = ""
        try:
            answer = await client.call(
                "RepositoryIndex",
                pb.RepositoryIndexRequest(ready=ready_only),
                timeout=2.0,
                what="its repository index",
            )
            return list(answer.models)
        except StageError as err:
            if err.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
        except Unavailable as err:
            problem = err.message
        # A plain OIP server, or a stage that is down: the models the ensembles name on it.
        models = []
        for model in sorted(m for m, k in self.stage_of_model.items() if k == key):
            ready = not problem and await self.model_ready(model, "")
            if ready:
                models.append(pb.RepositoryIndexResponse.ModelIndex(name=model, state="READY"))
            elif not ready_only:
                models.append(
                    pb.RepositoryIndexResponse.ModelIndex(
                        name=model, state="UNAVAILABLE", reason=problem or "not ready"
                    )
                )
        return models

    # --- stage models --------------------------------------------------------------------------------

    async def stage_client(self, name: str) -> StageClient:
        """The client of the stage that serves a stage model: the one its steps name or were given, else
        the first declared stage whose repository holds it (asked again for a model not seen yet)."""
        key = self.stage_of_model.get(name) or self.repository_models.get(name)
        # Ask again only where a stage has a repository index, or has not answered yet.
        if key is None and self.indexes and any(self.indexes.get(k, ()) is not None for k in self.clients):
            await self.refresh_index()
            key = self.repository_models.get(name)
        if key is None:
            served = sorted({*self.ensembles, *self.stage_of_model, *self.repository_models})
            raise ModelNotFound(
                f"unknown model '{echo(name)}' (served here: {echo(', '.join(served), 1000)})"
            )
        return self.clients[key]

    async def model_ready(self, name: str, version: str) -> bool:
        """Whether a stage model is ready, as its stage's `ModelReady` says (False for an unknown model)."""
        try:
            client = await self.stage_client(name)
        except ModelNotFound:
            return False
        try:
            reply = await client.call(
                "ModelReady",
                pb.ModelReadyRequest(name=name, version=version),
                timeout=2.0,
                what=f"model '{name}'",
            )
        except PipelineError:
            return False
        return reply.ready

    # --- health --------------------------------------------------------------------------------------

    async def monitor(
        self, interval: float = 1.0, on_ready: Callable[[bool], Awaitable[None]] | None = None
    ) -> None:
        """Keep each stage's health current, so readiness reflects stages that stop or return; `on_ready`
        hears of every change of `ready()` (the router's health service reports it)."""
        was_ready: bool | None = None
        changed = asyncio.Event()
        for client in self.clients.values():
            client.replicas.listeners.append(changed.set)
        while True:
            changed.clear()
            await asyncio.gather(*(c.replicas.check_health(timeout=interval) for c in self.clients.values()))
            if self.caching.holds_entries:
                # A version a stage stopped serving takes its cached responses with it.
                await self.refresh_index()
            ready = self.ready()
            if ready != was_ready and on_ready is not None:
                await on_ready(ready)
            if ready != was_ready and was_ready is not None:
                log.info(
                    "router %s", "ready: every stage is serving" if ready else "not ready: a stage is down"
                )
            was_ready = ready
            # The replicas' health watches wake this at once when a stage's readiness changes.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), interval)

    def ready(self) -> bool:
        """Whether every step has its stage, every stage model its signature, and every stage is healthy."""
        return (
            not self.unresolved
            and all(model in self.registry.signatures for model in self.stage_of_model)
            and all(c.replicas.healthy for c in self.clients.values())
        )

    async def close(self) -> None:
        """Stop asking for indexes and close every stage's client."""
        if self._refreshing is not None:
            self._refreshing.cancel()
        await asyncio.gather(*(c.close() for c in self.clients.values()))

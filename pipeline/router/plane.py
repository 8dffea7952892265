"""The router's entry point: serves every ensemble as a model, and the stage models behind them.

`RouterPlane` answers the protocol: it looks models up, answers their metadata, configuration, readiness
and statistics, and hands inference to the DAG executor (`pipeline.router.executor`), which calls the stages
through their clients (`pipeline.router.stage_client`). As Triton does for an ensemble's composing models, the
stage models named in steps are served here too, by forwarding to their stage. The process around it is
`pipeline.router.main`.
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
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.ensemble.pbtxt import ensemble_config
from pipeline.ensemble.plan import Catalog, EnsemblePlan, PlanStep, check_signatures
from pipeline.protocol.codec import metadata_response, select_version
from pipeline.protocol.errors import (
    ConfigError,
    InvalidInput,
    ModelNotFound,
    PipelineError,
    StageError,
    Unavailable,
)
from pipeline.protocol.types import BatchingConfig
from pipeline.router.cache import ResponseCache, Version, request_key
from pipeline.router.executor import ENSEMBLE_VERSION, Executor, batch_items
from pipeline.router.stage_client import StageClient
from pipeline.router.targets import Resolve
from pipeline.router.workers import WorkerPeers, merge_statistics
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.servicer import CallContext, DataPlane
from pipeline.runtime.statistics import ModelStats
from pipeline.runtime.telemetry import CACHE_HIT, ENSEMBLE, NO_SPAN, Telemetry

log = logging.getLogger(__name__)


#: How long a model served by several stages waits for an earlier declared stage that has not answered or
#: is still loading (it may serve the model too) before the first stage found serving it is used.
SETTLE_S = 30.0


class RouterPlane(DataPlane):
    """The router's data plane: ensembles run as DAGs of stage calls; stage models are forwarded."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        max_message_bytes: int = 64 * 1024 * 1024,
        telemetry: Telemetry | None = None,
        metrics: Metrics | None = None,
        stage_credentials: grpc.ChannelCredentials | None = None,
        stage_token: str | None = None,
        max_inflight_requests: int = 0,
        max_batch_items: int = 0,
        cache_size: int = 0,
        resolve_interval: float | None = None,
        resolve: Resolve | None = None,
    ) -> None:
        """`stage_credentials`: TLS for the stage calls; `stage_token`: the bearer token they carry (for
        stages that ask for one). `max_inflight_requests`: inference requests the
        router holds at once (more are refused UNAVAILABLE at once, so memory stays bounded under overload;
        0: no limit). `max_batch_items`: items (dimension 0) one request may carry (0: no limit).
        `cache_size`: bytes of the response cache, for the models and ensembles that enable it (0: off).
        `resolve_interval`: seconds between look-ups of the stages' DNS names (`resolve` looks them up;
        tests give their own)."""
        self.catalog = catalog
        self.telemetry = telemetry or Telemetry()
        self.metrics = metrics or Metrics()
        self.max_inflight_requests = max_inflight_requests
        self.max_batch_items = max_batch_items
        self._inflight = 0
        self.cache = ResponseCache(cache_size, self.metrics) if cache_size > 0 else None
        #: Stage model -> the version that answers a request naming none, as the stage last said.
        self.default_versions: dict[str, str] = {}
        self.clients = {
            key: StageClient(
                endpoint,
                max_message_bytes=max_message_bytes,
                metrics=self.metrics,
                credentials=stage_credentials,
                resolve_interval=resolve_interval,
                resolve=resolve,
                token=stage_token,
            )
            for key, endpoint in catalog.stages.items()
        }
        self.stage_of_model: dict[str, str] = catalog.stage_models()
        #: The ensembles served, each step's stage found once `discover` has found it.
        self.ensembles: dict[str, EnsemblePlan] = dict(catalog.ensembles)
        #: Models of steps that name no stage, until a stage's `RepositoryIndex` lists them.
        self._unresolved = {
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
        #: The other router workers on this port (`--workers`), whose statistics are summed with ours.
        self.peers: WorkerPeers | None = None
        self.executor = Executor(self.clients, telemetry=self.telemetry, metrics=self.metrics)
        self.executor.on_version = self._observe_version
        self.signatures = self.executor.signatures
        self.batchers = self.executor.batchers
        # Per ensemble, and per stage model called without batching (batchers keep their own).
        self.stats = self.executor.stats
        self.stats.update((name, ModelStats()) for name in (*catalog.ensembles, *self.stage_of_model))
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
        cache = self.cache
        if cache is not None:
            self.metrics.gauge(
                "pipeline_cache_bytes",
                "Bytes the response cache holds now",
                "cache",
                lambda: [("responses", cache.bytes)],
            )
            self.metrics.gauge(
                "pipeline_cache_waiting",
                "Requests waiting now for an identical request's response",
                "cache",
                lambda: [("responses", cache.waiting)],
            )
            self.metrics.gauge(
                "pipeline_cache_entries",
                "Responses the cache holds now",
                "cache",
                lambda: [("responses", len(cache))],
            )
        self.metrics.gauge(
            "pipeline_stage_inflight_calls",
            "The router's calls in flight to each replica of a stage",
            ("stage", "replica"),
            lambda: [
                ((key, r.address), r.outstanding)
                for key, c in clients.items()
                for r in c.replicas.by_address.values()
            ],
        )
        self.metrics.gauge(
            "pipeline_stage_replicas_ready",
            "Replicas of the stage whose health says SERVING",
            "stage",
            lambda: [(key, c.replicas.ready_count) for key, c in clients.items()],
        )
        self.metrics.gauge(
            "pipeline_stage_healthy",
            "1 when the stage's health check says SERVING",
            "stage",
            lambda: [(key, float(c.replicas.healthy)) for key, c in clients.items()],
        )

    # --- start-up and health -------------------------------------------------------------------------

    async def discover(self, *, retry_interval: float = 0.5) -> None:
        """Find the stage of every step that names none, learn every stage model's signature from its
        stage, waiting for stages that are not up yet, then check every ensemble against them (a mismatch
        raises `ConfigError`) and start the batchers."""
        for client in self.clients.values():
            client.start()
        await self._find_stages(retry_interval)
        for model, key in self.stage_of_model.items():
            self.clients[key].replicas.models.add(model)
        waiting_since = time.monotonic()
        reported: set[str] = set()
        # NOTE: `signatures` may also hold repository models that clients called meanwhile.
        while missing := [model for model in self.stage_of_model if model not in self.signatures]:
            for model in missing:
                key = self.stage_of_model[model]
                try:
                    self.signatures[model] = await self.clients[key].signature(model)
                except PipelineError as err:
                    if model not in reported or time.monotonic() - waiting_since > 30:
                        log.info("waiting for model '%s' on stage '%s': %s", model, key, err.message)
                        reported.add(model)
            if any(model not in self.signatures for model in missing):
                await asyncio.sleep(retry_interval)
        for plan in self.ensembles.values():
            check_signatures(plan, self.signatures)
        for model, signature in self.signatures.items():
            self.default_versions.setdefault(model, signature.versions[-1] if signature.versions else "")
        self._check_caching()
        for plan in self.ensembles.values():
            for step in plan.steps:
                batching = self._batching(step)
                if batching is not None and step.model_name not in self.batchers:
                    self.executor.add_batcher(step.model_name, self.clients[step.stage], batching)
        # Metadata answers before a stage has loaded its models: wait for every stage to be SERVING too.
        while not all(
            await asyncio.gather(*(c.replicas.check_health(timeout=2.0) for c in self.clients.values()))
        ):
            await asyncio.sleep(retry_interval)

    def _check_caching(self) -> None:
        """Refuse a response cache asked for a model that says its answers may differ for one request (an
        ensemble's cache covers every step's model); say when the cache is asked for but off."""
        errors = []
        for plan in self.ensembles.values():
            if not plan.response_cache:
                continue
            for step in sorted(plan.steps, key=lambda s: s.index):
                if not self.signatures[step.model_name].deterministic:
                    errors.append(
                        f"{plan.source}: response_cache is enabled, but {step.label} calls model "
                        f"'{step.model_name}', which declares itself non-deterministic (parameter "
                        'deterministic: "false"): a cached response would replay one of its answers for '
                        "requests that should get fresh ones; disable the ensemble's response_cache"
                    )
        for model in self.stage_of_model:
            signature = self.signatures[model]
            if signature.response_cache and not signature.deterministic:
                errors.append(
                    f"model '{model}' on stage '{self.stage_of_model[model]}': its config enables "
                    "response_cache but declares the model non-deterministic (parameter deterministic: "
                    '"false"); a cached response would replay one answer for requests that should get fresh ones'
                )
        if errors:
            raise ConfigError("\n".join(errors))
        asking = [p.name for p in self.ensembles.values() if p.response_cache] + [
            m for m in self.stage_of_model if self.signatures[m].response_cache
        ]
        if asking and self.cache is None:
            log.warning(
                "response_cache is enabled for %s, but the router's cache is off (--cache-size 0)",
                ", ".join(asking),
            )

    def _observe_version(self, model: str, asked: str, answered: str) -> None:
        """A stage answered `model`: when a request naming no version got another version than before, the
        old one's cached responses go (the stage serves a new default, or was reloaded)."""
        if asked or not answered:
            return
        known = self.default_versions.get(model)
        if known == answered:
            return
        self.default_versions[model] = answered
        if known is not None and self.cache is not None:
            dropped = self.cache.drop(model, known)
            log.info(
                "model '%s' now answers as version %s (was %s): %d cached responses dropped",
                model,
                answered,
                known or "unknown",
                dropped,
            )

    def _batching(self, step: PlanStep) -> BatchingConfig | None:
        """How a step's model is batched: as the ensemble says, else as the model's own config says."""
        if step.batching is not None or not step.model_batching:
            return step.batching
        own = self.signatures[step.model_name].batching
        if own is not None and step.model_name not in self.batchers:
            log.info("model '%s': batched as its own dynamic_batching says (%s)", step.model_name, own)
        return own

    async def _find_stages(self, retry_interval: float) -> None:
        """Give each step that names no stage the stage whose `RepositoryIndex` lists its model as READY
        (the first declared where several do: an earlier stage that has not answered yet or is still loading
        is waited for, up to `SETTLE_S`), waiting for stages that are down or still loading."""
        waiting_since: float | None = None
        started = time.monotonic()
        while True:
            await self.refresh_index()
            for model in sorted(self._unresolved):
                # The first declared stage that serves it: a stage declared before that one and still
                # loading (not SERVING yet) may list it later, so wait for it to settle.
                found = [key for key in self.clients if model in (self.indexes.get(key) or ())]
                if not found:
                    continue
                before = list(self.clients)[: list(self.clients).index(found[0])]
                if time.monotonic() - started < SETTLE_S and any(
                    key not in self.indexes
                    or (self.indexes[key] is not None and not self.clients[key].replicas.healthy)
                    for key in before
                ):
                    continue
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
                self.stats.setdefault(model, ModelStats())
                self._unresolved.discard(model)
            if not self._unresolved:
                break
            if not self.clients:
                raise ConfigError(
                    f"no stage to serve model(s) {', '.join(sorted(self._unresolved))}: a step names no stage "
                    "and the router has none (give them with --stage NAME=ADDRESS)"
                )
            if len(self.indexes) == len(self.clients) and all(m is None for m in self.indexes.values()):
                raise ConfigError(
                    f"no stage can say whether it serves model(s) {', '.join(sorted(self._unresolved))}: "
                    f"none of {', '.join(self.clients)} implements RepositoryIndex; name the stage in the step"
                )
            now = time.monotonic()
            if waiting_since is None or now - waiting_since > 30:
                waiting_since = now
                asked = ", ".join(f"'{key}' ({c.endpoint.address})" for key, c in self.clients.items())
                log.info(
                    "waiting for a stage that serves model(s) %s: no RepositoryIndex of %s lists them as "
                    "READY yet",
                    ", ".join(sorted(self._unresolved)),
                    asked,
                )
            await asyncio.sleep(retry_interval)
        self.ensembles = {name: self._resolved(plan) for name, plan in self.ensembles.items()}

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
        if self.cache is not None:
            self._drop_unserved()

    def _drop_unserved(self) -> None:
        """Drop the cached responses of every version that its stage's `RepositoryIndex` no longer lists as
        READY (a stage without the RPC cannot say; NOT_FOUND and version changes cover it)."""
        assert self.cache is not None
        for model, version in self.cache.versions():
            key = self.stage_of_model.get(model) or self.repository_models.get(model)
            index = self.indexes.get(key) if key is not None else None
            if index is None or not version:
                continue
            if version not in index.get(model, frozenset()):
                dropped = self.cache.drop(model, version)
                log.info(
                    "model '%s' version %s is no longer served: %d cached responses dropped",
                    model,
                    version,
                    dropped,
                )

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
            if self.cache is not None and len(self.cache):
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
        return (
            not self._unresolved
            and all(model in self.signatures for model in self.stage_of_model)
            and all(c.replicas.healthy for c in self.clients.values())
        )

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        await self.executor.close()
        await asyncio.gather(*(c.close() for c in self.clients.values()))

    # --- model lookup --------------------------------------------------------------------------------

    def _ensemble(self, name: str, version: str) -> EnsemblePlan | None:
        plan = self.ensembles.get(name)
        if plan is not None:
            select_version(name, (ENSEMBLE_VERSION,), version)
        return plan

    async def _stage_client(self, name: str) -> StageClient:
        """The client of the stage that serves a stage model: the one its steps name or were given, else
        the first declared stage whose repository holds it (asked again for a model not seen yet)."""
        key = self.stage_of_model.get(name) or self.repository_models.get(name)
        # Ask again only where a stage has a repository index, or has not answered yet.
        if key is None and self.indexes and any(self.indexes.get(k, ()) is not None for k in self.clients):
            await self.refresh_index()
            key = self.repository_models.get(name)
        if key is None:
            served = sorted({*self.ensembles, *self.stage_of_model, *self.repository_models})
            raise ModelNotFound(f"unknown model '{name}' (served here: {', '.join(served)})")
        return self.clients[key]

    async def _learn(self, name: str, client: StageClient) -> None:
        """A repository model that no ensemble names, called for the first time: learn its signature and,
        where its config sets `dynamic_batching`, batch its calls as that says."""
        signature = await client.signature(name)
        if name in self.signatures:  # learnt by a concurrent call meanwhile
            return
        self.signatures[name] = signature
        self.stats.setdefault(name, ModelStats())
        self.default_versions.setdefault(name, signature.versions[-1] if signature.versions else "")
        if signature.response_cache and not signature.deterministic:
            log.error(
                "model '%s': its config enables response_cache but declares the model non-deterministic; "
                "its responses are not cached",
                name,
            )
        if signature.batching is not None:
            log.info("model '%s': batched as its own dynamic_batching says (%s)", name, signature.batching)
            self.executor.add_batcher(name, client, signature.batching)

    async def model_ready(self, name: str, version: str) -> bool:
        try:
            plan = self._ensemble(name, version)
        except ModelNotFound:
            return False
        if plan is not None:
            return self.ready() and all(self.clients[step.stage].replicas.healthy for step in plan.steps)
        try:
            client = await self._stage_client(name)
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

    async def model_metadata(self, name: str, version: str, call: CallContext) -> pb.ModelMetadataResponse:
        plan = self._ensemble(name, version)
        if plan is not None:
            return metadata_response(plan.name, (ENSEMBLE_VERSION,), "ensemble", plan.inputs, plan.outputs)
        request = pb.ModelMetadataRequest(name=name, version=version)
        client = await self._stage_client(name)
        return await client.call(
            "ModelMetadata", request, timeout=call.timeout, metadata=call.metadata, what=f"model '{name}'"
        )

    async def model_config(self, name: str, version: str, call: CallContext) -> mc.ModelConfig:
        plan = self._ensemble(name, version)
        if plan is not None:
            return ensemble_config(plan)
        request = pb.ModelConfigRequest(name=name, version=version)
        client = await self._stage_client(name)
        reply = await client.call(
            "ModelConfig", request, timeout=call.timeout, metadata=call.metadata, what=f"model '{name}'"
        )
        return reply.config

    # --- inference -----------------------------------------------------------------------------------

    async def infer(self, request: pb.ModelInferRequest, call: CallContext) -> pb.ModelInferResponse:
        limit = self.max_inflight_requests
        if limit and self._inflight >= limit:
            # NOTE: refused before anything is kept or queued: under overload the router sheds load at the
            # door instead of holding every request's tensors until it runs out of memory.
            raise Unavailable(
                f"the router is saturated: {self._inflight} requests in flight (max_inflight_requests "
                f"{limit}); retry later"
            )
        self._inflight += 1
        try:
            return await self._infer(request, call)
        finally:
            self._inflight -= 1

    def _check_items(self, request: pb.ModelInferRequest, batching: bool) -> None:
        """Refuse a request carrying more items (dimension 0) than `max_batch_items` allows."""
        limit = self.max_batch_items
        if not limit or not batching:
            return
        for tensor in request.inputs:
            if tensor.shape and tensor.shape[0] > limit:
                raise InvalidInput(
                    f"input '{tensor.name}': {tensor.shape[0]} batch items, more than a request may carry "
                    f"here ({limit}, max_batch_items)"
                )

    async def _infer(self, request: pb.ModelInferRequest, call: CallContext) -> pb.ModelInferResponse:
        plan = self._ensemble(request.model_name, request.model_version)
        name = request.model_name
        client: StageClient | None = None
        if plan is not None:
            if self._unresolved and not all(step.stage for step in plan.steps):
                raise Unavailable(
                    f"ensemble '{name}' is not ready: waiting for a stage that serves "
                    f"{', '.join(sorted(self._unresolved))}"
                )
            self._check_items(request, plan.max_batch_size > 0)
        else:
            client = await self._stage_client(name)
            # An ensemble member is learnt (and batched as its steps say) by `discover`.
            member = name in self.stage_of_model or name in self._unresolved
            if not member and name not in self.signatures:
                await self._learn(name, client)
        if plan is None and (signature := self.signatures.get(name)) is not None:
            self._check_items(request, signature.max_batch_size > 0)
        versions = self._cache_versions(plan, name, request.model_version)
        if versions is not None:
            return await self._cached(name, plan, client, request, call, versions)
        return await self._execute(name, plan, client, request, call)

    def _cache_versions(
        self, plan: EnsemblePlan | None, name: str, version: str
    ) -> tuple[Version, ...] | None:
        """The versions that would answer a request, for its cache key; None when it is not to be cached."""
        if self.cache is None:
            return None
        if plan is not None:
            if not plan.response_cache:
                return None
            steps = sorted(plan.steps, key=lambda s: s.index)
            return tuple(
                dict.fromkeys(
                    (s.model_name, s.model_version or self.default_versions.get(s.model_name, ""))
                    for s in steps
                )
            )
        signature = self.signatures.get(name)
        if signature is None or not signature.response_cache or not signature.deterministic:
            return None
        return ((name, version or self.default_versions.get(name, "")),)

    def _stats_of(self, name: str) -> ModelStats:
        """The statistics `ModelStatistics` reports for a model: its batcher's where it has one."""
        if name in self.batchers and name not in self.ensembles:
            return self.batchers[name][0].stats
        return self.stats.setdefault(name, ModelStats())

    async def _cached(
        self,
        name: str,
        plan: EnsemblePlan | None,
        client: StageClient | None,
        request: pb.ModelInferRequest,
        call: CallContext,
        versions: tuple[Version, ...],
    ) -> pb.ModelInferResponse:
        """Answer from the response cache, or run the request and keep its response there."""
        assert self.cache is not None
        started = time.perf_counter_ns()
        key = request_key(name, versions, request)
        stats = self._stats_of(name)
        computed = False

        async def compute() -> tuple[bytes, tuple[Version, ...]]:
            nonlocal computed
            computed = True
            response = await self._execute(name, plan, client, request, call)
            # A stage model's entry belongs to the version that answered.
            answered = versions if plan is not None else ((name, response.model_version or versions[0][1]),)
            return response.SerializeToString(), answered

        deadline = None if call.timeout is None else time.monotonic() + call.timeout
        try:
            raw, hit, cache_ns = await self.cache.fetch(key, compute, deadline=deadline)
        except BaseException as err:
            if not computed:  # the request it waited for failed and this one ran out of time
                stats.request_failed(time.perf_counter_ns() - started)
            if isinstance(err, StageError) and err.code == grpc.StatusCode.NOT_FOUND:
                for model, version in versions:
                    self.cache.drop(model, version)
            raise
        span = self.telemetry.current_span() if self.telemetry.enabled else None
        if span is not None:
            span.set_attribute(CACHE_HIT, hit)
        self.metrics.cache_requests.labels(name, "hit" if hit else "miss").inc()
        if not hit:
            stats.cache_missed(cache_ns)
            return pb.ModelInferResponse.FromString(raw)
        response = pb.ModelInferResponse.FromString(raw)
        response.id = request.id
        if plan is not None:
            first = request.inputs[0].shape if request.inputs else ()
            items = int(first[0]) if plan.max_batch_size > 0 and first else 1
        else:
            items = batch_items(
                self.signatures.get(name), response.outputs[0].shape if response.outputs else ()
            )
        stats.cache_hit_done(items=items, total_ns=time.perf_counter_ns() - started, cache_ns=cache_ns)
        return response

    async def _execute(
        self,
        name: str,
        plan: EnsemblePlan | None,
        client: StageClient | None,
        request: pb.ModelInferRequest,
        call: CallContext,
    ) -> pb.ModelInferResponse:
        """Run a request: an ensemble's steps, a batched stage model's queue, or a forwarded call."""
        batched = plan is None and name in self.batchers
        started = time.perf_counter_ns()
        # A batched stage model's statistics are its batcher's (queue and batch figures included).
        stats = None if batched else self.stats.get(name)
        try:
            if plan is not None:
                if self.telemetry.enabled and (span := self.telemetry.current_span()) is not None:
                    span.set_attribute(ENSEMBLE, plan.name)
                response, items = await self.executor.run(plan, request, call)
            elif batched:
                response, items = await self.executor.infer_batched(request, call)
            else:
                assert client is not None
                with self.executor.stage_call_span(name, client) if self.telemetry.enabled else NO_SPAN:
                    response = await client.call(
                        "ModelInfer",
                        request,
                        timeout=call.timeout,
                        metadata=self.telemetry.inject(call.metadata),
                        what=f"model '{name}'",
                    )
                items = batch_items(
                    self.signatures.get(name), response.outputs[0].shape if response.outputs else ()
                )
                self._observe_version(name, request.model_version, response.model_version)
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

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        """This router's statistics; with several workers, every worker's summed (one view)."""
        own = await self.local_statistics(name, version)
        if self.peers is None:
            return own
        return merge_statistics([own, *await self.peers.peer_statistics(name, version)])

    async def local_statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        """This process's own statistics."""
        names = [name] if name else sorted({*self.stats, *self.repository_models})
        reply = pb.ModelStatisticsResponse()
        for model in names:
            if model in self.batchers:
                stats = self.batchers[model][0].stats
            elif model in self.stats:
                stats = self.stats[model]
            elif model in self.repository_models:
                stats = ModelStats()  # served here, not called yet
            else:
                raise ModelNotFound(f"unknown model '{model}'")
            reply.model_stats.append(stats.proto(model, version or ENSEMBLE_VERSION))
        return reply

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

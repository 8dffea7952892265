"""The router's data plane: serves every ensemble as a model, and the stage models behind them.

`RouterPlane` answers the protocol by delegating: the stages behind it and which of them serves each model
are `pipeline.router.stages.discovery`'s, which ensembles can be served and the router's readiness
`pipeline.router.execution.availability`'s; what is known of each model (signatures, batchers,
statistics) is the `pipeline.router.registry`'s, learnt by discovery off the request path; ensembles run on the DAG executor
(`pipeline.router.execution.executor`) and stage models are called through `pipeline.router.scheduling.dispatch`, batched or
forwarded; the response cache's policy is `pipeline.router.caching.cache_policy`'s. An ensemble with a decoupled step,
and a decoupled stage model, answer on streams only, with many responses per request
(`pipeline.router.execution.streaming`). As Triton does for an ensemble's
composing models, the stage models named in steps are served here too, by forwarding to their stage. The
process around it is `pipeline.router.main`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.ensemble.catalog import declared_batching
from pipeline.ensemble.pbtxt import ensemble_config
from pipeline.ensemble.plan import Catalog, EnsemblePlan, ModelSignature
from pipeline.protocol.call_chain import CallChain
from pipeline.protocol.codec import metadata_response, select_version
from pipeline.protocol.errors import (
    ConfigError,
    InvalidInput,
    ModelNotFound,
    PipelineError,
    Unavailable,
    Unimplemented,
    echo,
)
from pipeline.protocol.parameters import int_parameter
from pipeline.protocol.streams import DECOUPLED_UNARY
from pipeline.protocol.types import BatchingConfig
from pipeline.router.caching.cache_policy import ResponseCaching
from pipeline.router.execution.availability import EnsembleAvailability, repository_index
from pipeline.router.execution.executor import Executor
from pipeline.router.execution.streaming import EnsembleStreams
from pipeline.router.inflight import InflightDoor
from pipeline.router.registry import ENSEMBLE_VERSION, ModelRegistry
from pipeline.router.router_statistics import RouterStatistics
from pipeline.router.scheduling.dispatch import StageDispatcher
from pipeline.router.stages.discovery import StageDiscovery
from pipeline.router.stages.fleet import FleetControl
from pipeline.router.stages.stage_client import StageClient
from pipeline.router.stages.targets import Resolve
from pipeline.runtime.data_plane import DataPlane, RequestContext
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.model_statistics import ModelStats
from pipeline.runtime.security import ClientTls
from pipeline.runtime.telemetry import Telemetry

log = logging.getLogger(__name__)


class RouterPlane(DataPlane):
    """The router's data plane: ensembles run as DAGs of stage calls; stage models are forwarded."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        max_message_bytes: int = 64 * 1024 * 1024,
        telemetry: Telemetry | None = None,
        metrics: Metrics | None = None,
        stage_tls: ClientTls | None = None,
        stage_token: str | None = None,
        max_inflight_requests: int = 0,
        max_batch_items: int = 0,
        cache_size: int = 0,
        resolve_interval: float | None = None,
        resolve: Resolve | None = None,
        strict_readiness: bool = True,
        exit_on_error: bool = True,
        model_control: bool = False,
        admin_configured: bool = False,
    ) -> None:
        """`max_message_bytes`, `stage_tls`, `stage_token`, `resolve_interval` and `resolve`: how the stages
        are called (see `_stage_clients`). `max_inflight_requests`: inference requests held at once, in all
        and per model (`pipeline.router.inflight`; 0: no limit). `max_batch_items`: items (dimension 0) one
        request may carry (0: no limit). `cache_size`: bytes of the response cache, for the models and
        ensembles enabling it (0: off). `strict_readiness`: ready only while every ensemble is available and
        every stage healthy (Triton's `--strict-readiness`, its default), else once started. `exit_on_error`:
        an ensemble that fails its checks at start-up raises `ConfigError` (Triton's `--exit-on-error`, its
        default), else it is UNAVAILABLE with the reason and the others serve. `model_control` (explicit model
        control) or `admin_configured` allow `RepositoryModelLoad`/`Unload`, through the router."""
        self.telemetry = telemetry = telemetry or Telemetry()
        self.metrics = metrics = metrics or Metrics()
        self.door = InflightDoor(max_inflight_requests)
        self.exit_on_error, self.max_batch_items = exit_on_error, max_batch_items
        self.registry = registry = ModelRegistry()
        self.caching = caching = ResponseCaching(registry, cache_size, telemetry=telemetry, metrics=metrics)
        self.dispatcher = StageDispatcher(registry, caching, telemetry=telemetry, metrics=metrics)
        clients = _stage_clients(
            catalog, metrics, max_message_bytes, stage_tls, stage_token, resolve_interval, resolve
        )
        self.stages = StageDiscovery(catalog, clients, registry, metrics, found=self._found)
        self.ensembles = EnsembleAvailability(
            catalog, self.stages, registry, strict_readiness=strict_readiness
        )
        self.fleet = FleetControl(
            self.stages,
            self.ensembles,
            explicit=model_control,
            admin_configured=admin_configured,
            metrics=metrics,
            relearn=functools.partial(_relearn, self),
        )
        self.executor = Executor(registry, clients, self.dispatcher, telemetry=telemetry, metrics=metrics)
        self.streams = EnsembleStreams(self.executor)
        #: The ensembles with a decoupled step and the decoupled stage models: served by `stream` only.
        self.decoupled: set[str] = set()
        #: The stage models found on the stages whose signature their stage could not give at the last look.
        self._unlearnt: dict[str, PipelineError] = {}
        #: The answers to `ModelStatistics`: the router's own figures, and its stage models' replicas'.
        batched = self.dispatcher.batching.batchers
        self.model_statistics = RouterStatistics(self.stages, registry, self._versions, batched)
        self._count_models((*catalog.ensembles, *self.stages.stage_of_model))

    async def reload(self, catalog: Catalog) -> None:
        """Serve the ensembles of `catalog`, their files read again (see `EnsembleAvailability.reload`)."""
        await self.ensembles.reload(catalog)
        self._count_models(catalog.ensembles)

    def _count_models(self, names: Iterable[str]) -> None:
        """Give each model or ensemble of `names` that has no statistics yet its own."""
        stats = self.registry.stats
        stats.update((name, ModelStats()) for name in names if name not in stats)

    # --- start-up and health -------------------------------------------------------------------------

    async def discover(self, *, retry_interval: float = 0.5) -> None:
        """Wait for the stages, then serve every ensemble whose models they serve: each checked against its
        models' signatures (a mismatch raises `ConfigError`) and its steps batched. The others are
        UNAVAILABLE until their models are served (see `EnsembleAvailability`). Every other model of the
        stages' repositories is learnt too (`_found`)."""
        await self.ensembles.discover(retry_interval, self._serve, exit_on_error=self.exit_on_error)
        await self.stages.refresh_index()

    def _serve(self, plan: EnsemblePlan) -> None:
        """An ensemble whose models are known: its response cache checked, its steps batched, and whether it
        (or a stage model it calls) is decoupled, so answers on streams only."""
        self.caching.check([plan], {step.model_name: step.stage for step in plan.steps})
        catalog = self.ensembles.catalog
        declared = declared_batching(catalog.ensembles.values())
        self.dispatcher.batching.batch_steps(plan, self.stages.clients, declared, catalog.repository)
        signatures = self.registry.signatures
        self.decoupled.update(name for name, signature in signatures.items() if signature.decoupled)
        if self.streams.source(plan) is not None:
            self.decoupled.add(plan.name)
        # A client may call a batched step's model directly too: its requests merge as a plain model's.
        _note_front_batches(self, plan, {step.model_name for step in plan.steps})

    def front_batch(self, model: str) -> int:
        return self.registry.front_batches.get(model, 0)

    async def monitor(
        self, interval: float = 1.0, on_ready: Callable[[bool], Awaitable[None]] | None = None
    ) -> None:
        """Keep each stage's health and each ensemble's availability current (see
        `EnsembleAvailability.monitor`), and each replica serving what the fleet serves
        (`FleetControl.run`)."""
        await asyncio.gather(self.ensembles.monitor(interval, on_ready), self.fleet.run(interval))

    def ready(self) -> bool:
        return self.ensembles.ready()

    async def close(self) -> None:
        await self.dispatcher.close()
        await self.stages.close()

    # --- model lookup --------------------------------------------------------------------------------

    def _ensemble(self, name: str, version: str) -> EnsemblePlan | None:
        """The plan of the ensemble `name` (None: no ensemble has that name); `Unavailable` with the reason
        for an ensemble that failed to load."""
        failed = self.ensembles.failed.get(name)
        if failed is not None:
            raise Unavailable(f"ensemble '{name}' is not available: {failed}")
        plan = self.ensembles.plans.get(name)
        if plan is not None:
            select_version(name, (ENSEMBLE_VERSION,), version)
        return plan

    async def _found(self, found: Mapping[str, StageClient]) -> None:
        """Discovery's look at the stages found `found` (model -> its stage's client): the cached responses of
        the versions no stage serves any more are dropped, and each repository model that no ensemble names
        and that is not learnt yet is learnt: its signature, and where its config sets `dynamic_batching`,
        its batcher (an ensemble's models are learnt, and batched as its steps say, with their ensemble). A
        model whose stage cannot say now is asked again at the next look."""
        self.caching.drop_unserved(self.stages.ready_versions)
        members, signatures = self.ensembles.members, self.registry.signatures
        new = [
            (name, client) for name, client in found.items() if name not in signatures and name not in members
        ]
        if not new:
            return
        answers = await asyncio.gather(
            *(client.signature(name) for name, client in new), return_exceptions=True
        )
        for (name, client), answer in zip(new, answers, strict=True):
            if isinstance(answer, PipelineError):
                known = self._unlearnt.get(name)
                if known is None or known.message != answer.message:
                    log.warning("model '%s': its stage gives no signature now: %s", name, answer.message)
                self._unlearnt[name] = answer
            elif isinstance(answer, BaseException):
                raise answer
            elif self.registry.learn(name, answer):
                self._unlearnt.pop(name, None)
                self._serve_model(name, client, answer)

    def _serve_model(self, name: str, client: StageClient, signature: ModelSignature) -> None:
        """A repository model that no ensemble names, learnt now: its cache policy, whether it answers on
        streams only, and its batcher where its config sets `dynamic_batching`."""
        self.caching.learn(name, signature)
        if signature.decoupled:
            self.decoupled.add(name)
        if signature.batching is not None:
            log.info("model '%s': batched as its own dynamic_batching says (%s)", name, signature.batching)
            self.dispatcher.batching.add(name, client, signature.batching)
            _note_front_batches(self, None, (name,))

    async def _discovered(self, name: str) -> None:
        """Wait for discovery to learn a stage model first asked for now (its folder added, or its stage
        come up, a moment ago): the look at the stages in flight, and where that one began too early, the
        next. Raises what its stage answered where it could not give the model's signature."""
        for _ in range(2):
            await self.stages.refresh_index()
            if name in self.registry.signatures:
                return
        raise self._unlearnt.get(name) or ModelNotFound(f"unknown model '{echo(name)}'")

    async def model_ready(self, name: str, version: str) -> bool:
        try:
            plan = self._ensemble(name, version)
        except (ModelNotFound, Unavailable):
            return False
        if plan is not None:
            return await self.ensembles.ensemble_ready(name)
        return await self.stages.model_ready(name, version)

    async def model_metadata(self, name: str, version: str, call: RequestContext) -> pb.ModelMetadataResponse:
        plan = self._ensemble(name, version)
        if plan is not None:
            return metadata_response(plan.name, (ENSEMBLE_VERSION,), "ensemble", plan.inputs, plan.outputs)
        request = pb.ModelMetadataRequest(name=name, version=version)
        client = await self.stages.stage_client(name)
        return await client.call(
            "ModelMetadata", request, timeout=call.timeout, metadata=call.metadata, what=f"model '{name}'"
        )

    async def model_config(self, name: str, version: str, call: RequestContext) -> mc.ModelConfig:
        plan = self._ensemble(name, version)
        if plan is not None:
            return ensemble_config(plan, decoupled=plan.name in self.decoupled)
        request = pb.ModelConfigRequest(name=name, version=version)
        client = await self.stages.stage_client(name)
        reply = await client.call(
            "ModelConfig", request, timeout=call.timeout, metadata=call.metadata, what=f"model '{name}'"
        )
        return reply.config

    # --- inference -----------------------------------------------------------------------------------

    async def infer(self, request: pb.ModelInferRequest, call: RequestContext) -> pb.ModelInferResponse:
        door, name = self.door, request.model_name
        door.enter(name)
        try:
            return await self._infer(request, _prioritized(request, call))
        finally:
            door.leave(name)

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

    async def _infer(self, request: pb.ModelInferRequest, call: RequestContext) -> pb.ModelInferResponse:
        plan = self._ensemble(request.model_name, request.model_version)
        name = request.model_name
        client: StageClient | None = None
        if plan is not None:
            plan = await self.ensembles.available_plan(name, call.timeout)
            self._check_items(request, plan.max_batch_size > 0)
        else:
            client = await self.stages.stage_client(name)
            # An ensemble member is learnt (and batched as its steps say) with its ensemble.
            if name not in self.registry.signatures and name not in self.ensembles.members:
                await self._discovered(name)
        if plan is None and (signature := self.registry.signatures.get(name)) is not None:
            self._check_items(request, signature.max_batch_size > 0)
        versions = self.caching.versions(plan, name, request.model_version)
        if versions is not None:
            return await self.caching.fetch(
                plan, request, call, versions, lambda: self._execute(plan, client, request, call)
            )
        return await self._execute(plan, client, request, call)

    async def stream(
        self, request: pb.ModelInferRequest, call: RequestContext
    ) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
        """The responses to one request for a decoupled ensemble (`pipeline.router.execution.streaming`) or a decoupled
        stage model (forwarded to its stage), in order, the last marked final."""
        plan = self._ensemble(request.model_name, request.model_version)
        call = _prioritized(request, call)
        if plan is not None:
            self._check_items(request, plan.max_batch_size > 0)
            replies = self.streams.stream(plan, request, call)
        else:
            client = await self.stages.stage_client(request.model_name)
            what = f"model '{request.model_name}'"
            replies = client.stream(request, timeout=call.timeout, metadata=call.metadata, what=what)
        async with contextlib.aclosing(replies):
            async for reply in replies:
                yield reply

    async def _execute(
        self,
        plan: EnsemblePlan | None,
        client: StageClient | None,
        request: pb.ModelInferRequest,
        call: RequestContext,
    ) -> pb.ModelInferResponse:
        """Run a request: an ensemble's steps, or a stage model's call (batched or not, as the dispatcher
        decides)."""
        if self.decoupled and request.model_name in self.decoupled:
            raise Unimplemented(DECOUPLED_UNARY.format(model=request.model_name))
        if plan is not None:
            return await self.executor.infer(plan, request, call)
        assert client is not None
        return await self.dispatcher.infer(client, request, call)

    # --- statistics and repository -------------------------------------------------------------------

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        """Every router worker's figures summed; a stage model's are its replicas' own
        (`pipeline.router.router_statistics`)."""
        return await self.model_statistics.answer(name, version)

    def _versions(self, model: str) -> Sequence[str]:
        """The versions of a model served here, oldest first: an ensemble's one; a stage model's as its stage's
        `RepositoryIndex` lists them READY, else as its `ModelMetadata` listed them; empty where none can say."""
        if model in self.stages.catalog.ensembles:
            return (ENSEMBLE_VERSION,)
        ready = self.stages.ready_versions(model)
        if ready:
            return sorted(ready, key=lambda v: (len(v), v))  # Triton's versions are integers: numeric order
        signature = self.registry.signatures.get(model)
        return signature.versions if signature is not None else ()

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        """The ensembles, then every stage's models (see `availability.repository_index`)."""
        return await repository_index(self.ensembles, ready_only)

    async def repository_load(
        self, name: str, parameters: Mapping[str, object], call: RequestContext
    ) -> None:
        """Load a stage model on every replica of its stage, or on none (`pipeline.router.stages.fleet`)."""
        await self.fleet.load(name, parameters, call)

    async def repository_unload(
        self, name: str, parameters: Mapping[str, object], call: RequestContext
    ) -> None:
        """Unload a stage model from every replica of its stage, or from none (`pipeline.router.stages.fleet`)."""
        await self.fleet.unload(name, parameters, call)


def _stage_clients(
    catalog: Catalog,
    metrics: Metrics,
    max_message_bytes: int,
    tls: ClientTls | None,
    token: str | None,
    resolve_interval: float | None,
    resolve: Resolve | None,
) -> dict[str, StageClient]:
    """A client for each stage of `catalog`, by key. `tls`: TLS for the stage calls (gRPC and frames);
    `token`: the bearer token they carry (for stages that ask for one); `resolve_interval`: seconds between
    look-ups of the stages' DNS names (`resolve` looks them up; tests give their own)."""
    return {
        key: StageClient(
            endpoint,
            max_message_bytes=max_message_bytes,
            metrics=metrics,
            tls=tls,
            resolve_interval=resolve_interval,
            resolve=resolve,
            token=token,
        )
        for key, endpoint in catalog.stages.items()
    }


def _prioritized(request: pb.ModelInferRequest, call: RequestContext) -> RequestContext:
    """`call` whose chain carries the request's `priority`, which the calls its models make inherit
    (`CallChain.priority`)."""
    if "priority" not in request.parameters:
        return call
    try:
        priority = int_parameter(request.parameters, "priority")
    except InvalidInput:
        return call  # a batcher refuses it, naming it; a model without one ignores it
    return replace(call, metadata=CallChain.prioritized(call.metadata, priority or 0))


async def _relearn(plane: RouterPlane, name: str) -> None:
    """A model loaded through the router: its signature learnt again, and where it changed, the model
    served as it says now: its batcher (the model's own `dynamic_batching`, else its ensembles'), whether
    it answers on streams only, and the ensembles that call it checked against it again. Where its stage
    cannot give the signature now, the one learnt before stays."""
    if name not in plane.registry.signatures:
        return  # discovery learns it as it is now
    client = await plane.stages.stage_client(name)
    try:
        signature = await client.signature(name)
    except PipelineError as err:
        log.warning("model '%s': loaded, but its stage gives no signature now: %s", name, err.message)
        return
    if not plane.registry.relearn(name, signature):
        return
    log.info("model '%s': loaded again with another signature; served as it says now", name)
    member = name in plane.ensembles.members
    batching = signature.batching
    if batching is None and member and not signature.sequence:
        declared = declared_batching(plane.ensembles.catalog.ensembles.values())
        batching = declared.get(name, (None, ""))[0]
    try:
        plane.dispatcher.batching.refit(name, client, batching)
    except ConfigError as err:  # an ensemble's batching the model no longer takes: its ensembles say why
        log.error("model '%s': not batched: %s", name, err)
    if member:
        plane.ensembles.refit(name)
    else:
        plane.caching.learn(name, signature)
    plane.decoupled.discard(name)
    if signature.decoupled:
        plane.decoupled.add(name)
    _note_front_batches(plane, None, (name,))


def _note_front_batches(plane: RouterPlane, plan: EnsemblePlan | None, models: Iterable[str]) -> None:
    """Note how many items the compiled front may merge requests of `plan` (where given) and of each of `models`
    into one request with: none for one that answers on streams, or whose responses are cached (each request is
    its own cache entry), or a model the router does not batch."""
    registry, caching, limit = plane.registry, plane.caching, plane.max_batch_items
    batchers, front_batches = plane.dispatcher.batching.batchers, registry.front_batches
    if plan is not None:
        merges = plan.name not in plane.decoupled and caching.versions(plan, plan.name, "") is None
        front_batches[plan.name] = front_batch_of(plan, registry.signatures, batchers, limit) if merges else 0
    for name in models:
        batched = batchers.get(name)
        if batched is None or caching.versions(None, name, "") is not None:
            front_batches[name] = 0
        else:
            front_batches[name] = model_front_batch(registry.signatures[name], batched[0].config, limit)


def model_front_batch(signature: ModelSignature, batching: BatchingConfig, max_batch_items: int) -> int:
    """The most items the compiled front may merge requests of a stage model that the router batches (as
    `batching` says) into one request with (0: none may be merged): its requests' rows reach the model in
    the batcher's merged calls anyway, unless it answers on streams or keeps a sequence's state."""
    if signature.max_batch_size <= 0 or signature.decoupled or signature.sequence:
        return 0
    limit = min(signature.max_batch_size, batching.max_batch_size)
    return min(limit, max_batch_items) if max_batch_items else limit


def front_batch_of(
    plan: EnsemblePlan,
    signatures: Mapping[str, ModelSignature],
    batched: Collection[str],
    max_batch_items: int,
) -> int:
    """The most items the compiled front may merge requests of `plan` into one request with (0: none may be
    merged), for an ensemble neither decoupled nor cached. Requests may be merged where that changes nothing
    but how the rows of each step's batches arrive: every step's model is batched here (`batched`: its calls
    merged along dimension 0 anyway), none is decoupled or a sequence's, and no condition or fan-out reads
    the values."""
    if plan.max_batch_size <= 0 or plan.conditional:
        return 0
    for step in plan.steps:
        signature = signatures.get(step.model_name)
        if step.for_each or step.model_name not in batched or signature is None:
            return 0
        if signature.decoupled or signature.sequence:
            return 0
    limit = plan.max_batch_size
    return min(limit, max_batch_items) if max_batch_items else limit

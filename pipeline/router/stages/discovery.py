"""The stages behind the router: their clients, what their repositories hold, which stage serves each model.

The router asks every stage's `RepositoryIndex` for the models it serves as READY (at start-up, when a
model is first asked for, and while an ensemble waits for its models or the response cache holds entries);
a model no step names a stage for is served by the first declared stage that lists it. Every model of the
stages' repositories is served through the router, ensemble or not. Which ensembles can be served is
`pipeline.router.execution.availability`'s.

Each replica of a stage is asked for its own index: replicas may serve different models (a load that failed
on one, or each started with its own `--load-model`). A stage serves what any of its replicas lists, and each
model's calls go only to the replicas that list it (`Replicas.pick`); `pipeline_stage_model_replicas_ready`
says how many serve each model.

Each look at the indexes (at start-up, every second while the router serves, when a request names a model
not seen yet, after a load through the router) hands the models found to the router's `found`, which learns
the signature of each new one and gives it its batcher, and drops the cached responses of the versions no
longer served: the request path only looks them up, and a request for a model that appeared a moment ago
waits for the look that finds it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Container, Iterable, Mapping

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import Catalog
from pipeline.protocol.errors import ModelNotFound, PipelineError, StageError, Unavailable, echo
from pipeline.router.registry import ModelRegistry
from pipeline.router.stages.replicas import DOWN, SERVING, Replica
from pipeline.router.stages.stage_client import StageClient
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.model_metrics import FAMILIES_METHOD, Snapshot, families_of, merge
from pipeline.runtime.model_statistics import ModelStats

log = logging.getLogger(__name__)

#: How long a scrape waits for a replica's model metric families.
FAMILIES_TIMEOUT_S = 2.0

#: What hears of every look at the stages' indexes: every model of the stages' repositories, with the client
#: of the stage that serves it.
Found = Callable[[Mapping[str, StageClient]], Awaitable[None]]


class StageDiscovery:
    """The stages' clients, their repository indexes, and the stage that serves each model."""

    def __init__(
        self,
        catalog: Catalog,
        clients: Mapping[str, StageClient],
        registry: ModelRegistry,
        metrics: Metrics | None = None,
        found: Found | None = None,
    ) -> None:
        """`clients`: stage key -> its client, in the order the stages are declared. A model found on a stage
        gets its statistics in `registry`; `found` hears of each look at the indexes (see the module's
        docstring)."""
        self.catalog = catalog
        self.clients = clients
        self.registry = registry
        #: Stage model -> the stage that serves it: as the steps name it, or as found.
        self.stage_of_model: dict[str, str] = catalog.stage_models()
        #: Stage key -> the models its `RepositoryIndex` lists as READY, with their READY versions; None for
        #: a stage without the RPC.
        self.indexes: dict[str, Mapping[str, frozenset[str]] | None] = {}
        #: Every model of the stages' repositories -> the first declared stage that serves it.
        self.repository_models: dict[str, str] = {}
        self._refreshing: asyncio.Future[None] | None = None
        self._found = found
        if metrics is not None:
            self._export_gauges(metrics)

    def _export_gauges(self, metrics: Metrics) -> None:
        clients = self.clients
        metrics.export_families(self.model_families)
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
            "pipeline_stage_model_replicas_ready",
            "Replicas of the stage whose health says SERVING and whose RepositoryIndex lists the model as READY",
            ("stage", "model"),
            lambda: [((key, model), count) for key, c in clients.items() for model, count in _serving(c)],
        )
        metrics.gauge(
            "pipeline_stage_healthy",
            "1 when the stage's health check says SERVING",
            "stage",
            lambda: [(key, float(c.replicas.healthy)) for key, c in clients.items()],
        )

    async def model_families(self) -> list[Snapshot]:
        """The metric families the models of every stage made (Triton's custom metrics,
        `pipeline.runtime.model_metrics`), each replica asked when the router is scraped and the series of
        equal labels added up; a replica that is down, or a server without the method, adds none."""
        asked = [
            (client, replica)
            for client in self.clients.values()
            for replica in list(client.replicas.by_address.values())
            if replica.state != DOWN
        ]
        answers = await asyncio.gather(*(_families_of(client, replica) for client, replica in asked))
        return merge(family for families in answers for family in families)

    # --- the stage of each model ------------------------------------------------------------------------

    def find_stage(self, model: str) -> str | None:
        """The stage that serves `model`: the one found before, else the first declared whose
        `RepositoryIndex` lists it as READY (noted in `stage_of_model`)."""
        if model in self.stage_of_model:
            return self.stage_of_model[model]
        found = [key for key in self.clients if model in (self.indexes.get(key) or ())]
        if not found:
            return None
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
        return found[0]

    def assign(self, model: str, key: str) -> None:
        """An ensemble's step calls `model` on stage `key`: a stage without a health service serves while
        the models called there are ready."""
        self.stage_of_model[model] = key
        self.clients[key].replicas.models.add(model)

    # --- repository indexes --------------------------------------------------------------------------

    async def refresh_index(self) -> None:
        """Ask every stage for its `RepositoryIndex` (READY models) now, and hand the models found to `found`;
        calls made meanwhile share one."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh_index())
        await asyncio.shield(self._refreshing)

    async def _refresh_index(self) -> None:
        keys = list(self.clients)
        found = await asyncio.gather(*(_index_of(self.clients[key]) for key in keys))
        for key, models in zip(keys, found, strict=True):
            if not isinstance(models, PipelineError):  # a stage that is down keeps what it said last
                self.indexes[key] = models
        served: dict[str, str] = {}
        for key in keys:
            for model in sorted(self.indexes.get(key) or ()):
                served.setdefault(model, key)
        self.repository_models = served
        if self._found is not None:
            clients = self.clients
            await self._found(
                {model: clients[self.stage_of_model.get(model, key)] for model, key in served.items()}
            )

    def ready_versions(self, model: str) -> frozenset[str] | None:
        """The versions of `model` that the stage serving it lists as READY; None where it cannot say (no
        stage serves it, or its stage has no `RepositoryIndex` or has not answered yet)."""
        key = self.stage_of_model.get(model) or self.repository_models.get(model)
        index = self.indexes.get(key) if key is not None else None
        return None if index is None else index.get(model, frozenset())

    async def stage_models_index(
        self, ready_only: bool, ensembles: Container[str]
    ) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        """Every stage's models as its own `RepositoryIndex` lists them (a model that several stages hold, as
        the stage that serves it here; none named like one of `ensembles`); a stage without the RPC lists
        the models the ensembles name on it."""
        keys = list(self.clients)
        answers = await asyncio.gather(*(self._stage_index(key, ready_only) for key in keys))
        owner: dict[str, str] = {}
        listed = []
        for key, models in zip(keys, answers, strict=True):
            for model in models:
                serving = self.stage_of_model.get(model.name) or owner.setdefault(model.name, key)
                if serving == key and model.name not in ensembles:
                    listed.append(model)
        return listed

    async def _stage_index(self, key: str, ready_only: bool) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        client = self.clients[key]
        problem = ""
        await client.replicas.settle()
        replicas = list(client.replicas.by_address.values())
        # Every replica's whole index, so that each model's state says how many replicas serve it.
        answers = await asyncio.gather(
            *(client.replica_index(r, ready_only=False) for r in replicas), return_exceptions=True
        )
        indexes = [(r.address, a) for r, a in zip(replicas, answers, strict=True) if isinstance(a, list)]
        if indexes:
            merged = _merged(indexes)
            return [m for m in merged if m.state == "READY"] if ready_only else merged
        for answer in answers:
            if isinstance(answer, StageError):
                raise answer
            if isinstance(answer, Unavailable):
                problem = answer.message
            elif isinstance(answer, BaseException):
                raise answer
        if not replicas:
            problem = f"stage '{key}' ({client.endpoint.address}) has no replica"
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
            served = sorted({*self.catalog.ensembles, *self.stage_of_model, *self.repository_models})
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

    async def close(self) -> None:
        """Stop asking for indexes and close every stage's client."""
        if self._refreshing is not None:
            self._refreshing.cancel()
        await asyncio.gather(*(c.close() for c in self.clients.values()))


async def _index_of(client: StageClient) -> Mapping[str, frozenset[str]] | PipelineError | None:
    """The models a stage serves as READY, with their READY versions: those that the `RepositoryIndex` of any
    of its replicas lists (each replica keeps its own, so that each model goes to the replicas that serve it),
    a replica that cannot answer now counting with what it said last unless it is down; None for a stage
    without the RPC (a plain OIP server); an error where no replica can answer now (the stage keeps what it
    said last)."""
    await client.replicas.settle()
    replicas = list(client.replicas.by_address.values())
    answers = await asyncio.gather(
        *(client.replica_index(r, ready_only=True) for r in replicas), return_exceptions=True
    )
    problem: PipelineError = Unavailable(f"stage '{client.endpoint.name}' has no replica")
    answered, counted = False, []
    for replica, answer in zip(replicas, answers, strict=True):
        if isinstance(answer, PipelineError):
            problem = answer
            if replica.state != DOWN:
                counted.append(replica)
        elif isinstance(answer, BaseException):
            raise answer
        else:
            replica.index = None if answer is None else ready_of(answer)
            answered = True
            counted.append(replica)
    if not answered:
        return problem
    if all(replica.index is None for replica in replicas):
        return None
    ready: dict[str, set[str]] = {}
    for replica in counted:
        for model, versions in (replica.index or {}).items():
            ready.setdefault(model, set()).update(versions)
    return {name: frozenset(versions) for name, versions in ready.items()}


async def _families_of(client: StageClient, replica: Replica) -> list[Snapshot]:
    """The model metric families of one replica; none where it cannot say."""
    ask: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = replica.channel.unary_unary(FAMILIES_METHOD)
    try:
        return families_of(await ask(b"", timeout=FAMILIES_TIMEOUT_S, metadata=client.auth))
    except grpc.aio.AioRpcError as err:
        if err.code() != grpc.StatusCode.UNIMPLEMENTED:  # a plain OIP server has no model families to give
            log.warning(
                "replica %s of stage '%s' gave no model metric families: %s %s",
                replica.address,
                client.endpoint.name,
                err.code().name,
                err.details(),
            )
    except ValueError as err:
        log.warning(
            "replica %s of stage '%s' answered its model metric families with %s",
            replica.address,
            client.endpoint.name,
            err,
        )
    return []


def ready_of(models: Iterable[pb.RepositoryIndexResponse.ModelIndex]) -> dict[str, frozenset[str]]:
    """The READY models of a `RepositoryIndex`, with their READY versions."""
    ready: dict[str, set[str]] = {}
    for model in models:
        if model.state == "READY":
            ready.setdefault(model.name, set()).add(model.version)
    return {name: frozenset(versions) for name, versions in ready.items()}


def _merged(
    indexes: Iterable[tuple[str, list[pb.RepositoryIndexResponse.ModelIndex]]],
) -> list[pb.RepositoryIndexResponse.ModelIndex]:
    """The replicas' `RepositoryIndex` entries (each with its replica's address) folded into one stage's: a
    model version is READY where any replica serves it, else in the state the first replica that lists it
    says; where the replicas disagree, the reason names each replica that is not READY, and how many are."""
    listed: dict[tuple[str, str], list[tuple[str, pb.RepositoryIndexResponse.ModelIndex]]] = {}
    answered = 0
    for address, models in indexes:
        answered += 1
        for model in models:
            listed.setdefault((model.name, model.version), []).append((address, model))
    merged = []
    for key in sorted(listed):
        entries = listed[key]
        ready = [address for address, m in entries if m.state == "READY"]
        first = next((m for _, m in entries if m.state == "READY"), entries[0][1])
        folded = pb.RepositoryIndexResponse.ModelIndex()
        folded.CopyFrom(first)
        if ready and len(ready) < answered:
            others = [
                f"{address}: {m.state}{f' ({m.reason})' if m.reason else ''}"
                for address, m in entries
                if m.state != "READY"
            ]
            missing = answered - len(entries)
            if missing:
                others.append(f"{missing} not listing it")
            folded.reason = f"READY on {len(ready)} of {answered} replicas; " + "; ".join(others)
        merged.append(folded)
    return merged


def _serving(client: StageClient) -> list[tuple[str, int]]:
    """Each model that a replica of the stage lists in its `RepositoryIndex`, and how many SERVING replicas
    list it."""
    replicas = list(client.replicas.by_address.values())
    models = sorted({model for r in replicas for model in r.index or ()})
    return [(model, sum(1 for r in replicas if r.state == SERVING and r.serves(model))) for model in models]

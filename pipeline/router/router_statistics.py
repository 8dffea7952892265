"""The router's `ModelStatistics`: an ensemble's figures are the router's own, and so are those of a stage
model that the router batches; any other stage model's are those of its stage's replicas, summed.

Triton's statistics of a model are the model's own: each request, and each execution of the batches its
scheduler formed. Where the router batches a model, its batcher is that scheduler: it sees each request, and
each of its batches is one execution on a replica. Elsewhere the router only forwards each request, and what
batches them is the stage (a sequence batcher, or a foreign server's own batching): the router's calls would
read 72 requests in 72 executions of one where the model ran them in 34 of 1 to 4. So when it is asked, the
router asks each replica of such a model's stage for its `ModelStatistics` and answers with their sum
(counts, durations, executions per batch size, a decoupled model's responses), to which it adds what only it
sees: the requests its response cache answered. A model whose replicas give no statistics (a server without
`ModelStatistics`, as a plain OIP server or MLServer, or replicas that cannot answer now) keeps the router's
own figures, its calls.

With several router workers (`pipeline.router.workers`), the worker asked sums every worker's figures, and
asks the stages once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container, Iterable, Sequence

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.router.registry import ModelRegistry
from pipeline.router.stages.discovery import StageDiscovery
from pipeline.router.stages.replicas import DOWN
from pipeline.router.stages.stage_client import StageClient
from pipeline.router.stages.stage_models import replica_statistics
from pipeline.router.workers import WorkerPeers, merge_statistics
from pipeline.runtime.model_statistics import add_statistics


class RouterStatistics:
    """The router's answers to `ModelStatistics`, for ensembles and stage models."""

    def __init__(
        self,
        stages: StageDiscovery,
        registry: ModelRegistry,
        versions_of: Callable[[str], Sequence[str]],
        batched: Container[str],
    ) -> None:
        """`versions_of(model)`: the versions of a model served here, oldest first (the default one last);
        `batched`: the stage models the router batches, whose figures are its own."""
        self.stages = stages
        self.registry = registry
        self.batched = batched
        self.versions_of = versions_of
        #: The other router workers on this port (`--workers`), whose figures are summed with ours.
        self.peers: WorkerPeers | None = None

    async def answer(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        """`ModelStatistics` of `name` (every model where "") at `version`: every worker's own figures, an
        unbatched stage model's replaced by its replicas' where they give them."""
        own = await self.local(name, version)
        routed = (
            own
            if self.peers is None
            else merge_statistics([own, *await self.peers.peer_statistics(name, version)])
        )
        batched = self.batched
        stage_models = [
            s.name for s in routed.model_stats if s.name not in batched and self._stage_of(s.name) is not None
        ]
        if not stage_models:
            return routed
        figures = await self._replica_figures(stage_models, name, version)
        if not figures:
            return routed
        hits = [await self.local_cache_hits(name, version)]
        if self.peers is not None:
            hits += await self.peers.peer_statistics(name, version, cache_hits=True)
        cached = {s.name: s for s in merge_statistics(hits).model_stats}
        for entry in routed.model_stats:
            summed = figures.get(entry.name)
            if summed is None:
                continue
            label = entry.version
            entry.CopyFrom(summed)
            entry.version = label  # the router's label: it counts a model whatever version answered
            if entry.name in cached:
                add_statistics(entry, cached[entry.name])
        return routed

    async def local(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        """This process's own figures: its ensembles' requests and its calls to stage models."""
        served = self.stages.repository_models
        if not name:
            # As Triton does: every model's statistics, at its default version, whatever version is asked.
            names = sorted({*self.registry.stats, *served})
            return self.registry.statistics(names, "", served, self.versions_of)
        return self.registry.statistics([name], version, served, self.versions_of)

    async def local_cache_hits(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        """What this process's response cache answered for the stage models of `name` (every one where "")."""
        reply = await self.local(name, version)
        cached = pb.ModelStatisticsResponse()
        for entry in reply.model_stats:
            model = entry.name
            stats = self.registry.stats.get(model)
            if stats is not None and self._stage_of(model) is not None:
                cached.model_stats.append(stats.cache_proto(model, entry.version))
        return cached

    def _stage_of(self, model: str) -> str | None:
        """The stage that serves a stage model (None for an ensemble, or a model no stage serves)."""
        if model in self.stages.catalog.ensembles:
            return None
        return self.stages.stage_of_model.get(model) or self.stages.repository_models.get(model)

    async def _replica_figures(
        self, models: Iterable[str], name: str, version: str
    ) -> dict[str, pb.ModelStatistics]:
        """Each of `models` that its stage's replicas give figures of -> their sum; every replica that is not
        down is asked once (for every model where `name` is "", as Triton answers it)."""
        by_stage: dict[str, set[str]] = {}
        for model in models:
            key = self._stage_of(model)
            if key is not None:
                by_stage.setdefault(key, set()).add(model)
        answers = await asyncio.gather(
            *(
                _stage_figures(self.stages.clients[key], wanted, name, version)
                for key, wanted in by_stage.items()
            )
        )
        return {model: stats for answer in answers for model, stats in answer.items()}


async def _stage_figures(
    client: StageClient, models: set[str], name: str, version: str
) -> dict[str, pb.ModelStatistics]:
    """The sum of the figures that the replicas of one stage give of `models`."""
    await client.replicas.settle()
    replicas = [r for r in client.replicas.by_address.values() if r.state != DOWN]
    answers = await asyncio.gather(*(replica_statistics(client, r, name, version) for r in replicas))
    summed: dict[str, pb.ModelStatistics] = {}
    for entries in answers:
        for entry in entries:
            if entry.name not in models:
                continue
            into = summed.get(entry.name)
            if into is None:
                summed[entry.name] = into = pb.ModelStatistics()
                into.CopyFrom(entry)
            else:
                add_statistics(into, entry)
    return summed

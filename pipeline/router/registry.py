"""The router's model registry: what it knows of each model it serves, with one owner.

Each stage model's signature (learnt from its stage), the batcher of each batched stage model, and the
statistics of every model (ensembles included) live here. The plane, the executor and the stage calls
share the one registry by reference: whoever learns something about a model writes it here, and every
reader sees it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container, Iterable, Sequence

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import ModelSignature
from pipeline.protocol.codec import Tensor, select_version
from pipeline.protocol.errors import ModelNotFound, echo
from pipeline.router.scheduling.batching import DynamicBatcher
from pipeline.router.scheduling.merge import BatchMember, TensorBatching
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.model_statistics import ModelStats

#: The version the router reports for every ensemble.
ENSEMBLE_VERSION = "1"

#: A batched stage model's batcher, and how its requests' tensors merge into a batch and split back.
Batched = tuple[DynamicBatcher[BatchMember, dict[str, Tensor]], TensorBatching]


class ModelRegistry:
    """The signatures, batchers and statistics of the models the router serves."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        """`metrics`: where the batchers' gauges (queue depth, batches in flight) are exported."""
        #: Stage model -> its interface, learnt from its stage (at start-up, or at its first call).
        self.signatures: dict[str, ModelSignature] = {}
        #: Batched stage model -> its batcher.
        self.batchers: dict[str, Batched] = {}
        #: Per ensemble, and per stage model called without batching (batchers keep their own).
        self.stats: dict[str, ModelStats] = {}
        if metrics is not None:
            self._export_gauges(metrics)

    def _export_gauges(self, metrics: Metrics) -> None:
        batchers = self.batchers
        metrics.gauge(
            "pipeline_queue_depth",
            "Requests waiting now",
            "model",
            lambda: [(model, b.queue_depth) for model, (b, _) in batchers.items()],
        )
        metrics.gauge(
            "pipeline_inflight_batches",
            "Executions running now",
            "model",
            lambda: [(model, b.inflight_batches) for model, (b, _) in batchers.items()],
        )

    def learn(self, name: str, signature: ModelSignature) -> bool:
        """Keep the signature of a stage model first called now, and give it statistics; False when a
        concurrent call learnt it meanwhile (the first one stays)."""
        if name in self.signatures:
            return False
        self.signatures[name] = signature
        self.stats.setdefault(name, ModelStats())
        return True

    def stats_of(self, name: str, *, ensemble: bool) -> ModelStats:
        """The statistics a request for a model counts in: a batched stage model's batcher's, else its own."""
        if not ensemble and name in self.batchers:
            return self.batchers[name][0].stats
        return self.stats.setdefault(name, ModelStats())

    def statistics(
        self,
        names: Iterable[str],
        version: str,
        served: Container[str],
        versions_of: Callable[[str], Sequence[str]],
    ) -> pb.ModelStatisticsResponse:
        """Triton's `ModelStatistics` of `names` (at `version`, or their default one); a model in `served` that
        no request called yet has none yet, any other unknown model raises `ModelNotFound`, and so does a
        version that `versions_of` the model does not list (oldest first; empty where no one can say)."""
        reply = pb.ModelStatisticsResponse()
        for model in names:
            if model in self.batchers:
                stats = self.batchers[model][0].stats
            elif model in self.stats:
                stats = self.stats[model]
            elif model in served:
                stats = ModelStats()  # served here, not called yet
            else:
                raise ModelNotFound(f"unknown model '{echo(model)}'")
            # The router counts a model's requests whatever version answered them: under its default one.
            versions = versions_of(model)
            label = select_version(model, versions, version) if versions else version or ENSEMBLE_VERSION
            reply.model_stats.append(stats.proto(model, label))
        return reply

    async def close(self) -> None:
        """Stop every batcher (queued requests fail)."""
        await asyncio.gather(*(batcher.aclose() for batcher, _ in self.batchers.values()))


def batch_items(signature: ModelSignature | None, shape: Sequence[int]) -> int:
    """Batch items in a tensor of `shape` for a model: dimension 0 if the model batches, else 1."""
    if signature is not None and signature.max_batch_size > 0 and len(shape) > 0:
        return int(shape[0])
    return 1

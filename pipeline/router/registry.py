"""The router's model registry: what it knows of each model it serves, with one owner.

Each stage model's signature (learnt from its stage by discovery) and the statistics of every model
(ensembles included; a batched stage model's are its batcher's) live here. The plane, the executor and the
dispatcher share the one registry by reference: discovery writes the signatures, and every reader sees
them. The batchers are the dispatcher's (`pipeline.router.scheduling`), which this module knows nothing of.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import ModelSignature
from pipeline.protocol.codec import select_version
from pipeline.protocol.errors import ModelNotFound, echo
from pipeline.runtime.model_statistics import ModelStats

#: The version the router reports for every ensemble.
ENSEMBLE_VERSION = "1"


class ModelRegistry:
    """The signatures and statistics of the models the router serves."""

    def __init__(self) -> None:
        #: Stage model -> its interface, learnt from its stage (at start-up, or when discovery finds it).
        self.signatures: dict[str, ModelSignature] = {}
        #: Per model: an ensemble's, a stage model's own, or a batched stage model's batcher's.
        self.stats: dict[str, ModelStats] = {}
        #: Per ensemble or batched stage model, the most items the compiled front may merge its requests into
        #: one with (0: none).
        self.front_batches: dict[str, int] = {}

    def learn(self, name: str, signature: ModelSignature) -> bool:
        """Keep the signature of a stage model that discovery found now, and give it statistics; False when
        it was learnt before (the first one stays)."""
        if name in self.signatures:
            return False
        self.signatures[name] = signature
        self.stats.setdefault(name, ModelStats())
        return True

    def relearn(self, name: str, signature: ModelSignature) -> bool:
        """Replace the signature of a stage model learnt before and loaded again; whether it changed."""
        if self.signatures.get(name) == signature:
            return False
        self.signatures[name] = signature
        return True

    def stats_of(self, name: str) -> ModelStats:
        """The statistics a request for a model counts in."""
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
            if model in self.stats:
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


def batch_items(signature: ModelSignature | None, shape: Sequence[int]) -> int:
    """Batch items in a tensor of `shape` for a model: dimension 0 if the model batches, else 1."""
    if signature is not None and signature.max_batch_size > 0 and len(shape) > 0:
        return int(shape[0])
    return 1

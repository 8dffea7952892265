"""What a stage service serves: each model's loaded versions, their instances and what they are doing.

`StagePlane` (`pipeline.stage.stage_plane`) keeps one `ServedModel` per model it knows, and one
`ServedVersion` per version loaded; `RepositoryIndex` and the gauges are read from them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.model_statistics import ModelStats
from pipeline.stage.pool import InstancePool
from pipeline.stage.sequence_batcher import SequenceBatcher


@dataclass(eq=False)
class ServedVersion:
    """A loaded version of a model."""

    name: str
    version: str
    #: What `ModelConfig` returns for it.
    config: mc.ModelConfig
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    pool: InstancePool
    #: Changes when the version's files or config do (repository models); "" for a `Stage` object.
    fingerprint: str = ""
    #: Set while no request is in flight; retiring waits for it.
    quiet: asyncio.Event = field(default_factory=asyncio.Event)
    inflight: int = 0
    retired: bool = False
    #: Answers with any number of responses (`pipeline.stage.decoupled`): served on streams only.
    decoupled: bool = field(init=False)
    #: `outputs` by name.
    output_specs: dict[str, TensorSpec] = field(init=False)
    #: The sequence batcher of a model with `sequence_batching` (`pipeline.stage.sequence_batcher`): every
    #: request goes through it.
    sequences: SequenceBatcher | None = None

    def __post_init__(self) -> None:
        self.quiet.set()
        self.decoupled = self.config.model_transaction_policy.decoupled
        self.output_specs = {spec.name: spec for spec in self.outputs}

    @property
    def max_batch_size(self) -> int:
        return self.config.max_batch_size

    @property
    def platform(self) -> str:
        return self.config.platform or self.config.backend


@dataclass
class ServedModel:
    """A model the plane knows: its served versions (oldest first) and why it serves none, if so."""

    name: str
    versions: dict[str, ServedVersion] = field(default_factory=dict)
    #: Whether it should serve (False once unloaded by request).
    wanted: bool = True
    reason: str = "loading"
    #: A `Stage` object given in code (not from the repository).
    fixed: bool = False
    stats: ModelStats = field(default_factory=ModelStats)
    #: Calls waiting for or running on an instance (kept by the event loop).
    pending: int = 0

    @property
    def running(self) -> int:
        return sum(s.started - s.finished for v in self.versions.values() for s in v.pool.slots)

    @property
    def waiting(self) -> int:
        # NOTE: a call cancelled while it runs leaves `pending` before its thread finishes; never below 0.
        return max(0, self.pending - self.running)


def index_entries(
    reply: pb.RepositoryIndexResponse,
    on_disk: Mapping[str, tuple[str, ...]],
    problems: Mapping[str, str],
    models: Mapping[str, ServedModel],
    ready_only: bool,
) -> None:
    """`RepositoryIndex`'s entries: each version on disk or served, READY or UNAVAILABLE and why."""
    for name in sorted(set(on_disk) | set(problems) | set(models)):
        model = models.get(name)
        served = model.versions if model else {}
        problem = problems.get(name, "")
        versions = (
            sorted(set(on_disk.get(name, ())) | set(served), key=int)
            if not model or not model.fixed
            else list(served)
        )
        for version in versions:
            if version in served:
                reply.models.add(name=name, version=version, state="READY")
            elif not ready_only:
                reason = problem or (model.reason if model and model.reason else "")
                if not reason:
                    reason = "unloaded" if model and not model.wanted else "not loaded"
                reply.models.add(name=name, version=version, state="UNAVAILABLE", reason=reason)
        if not versions and not ready_only:
            reason = problem or (model.reason if model else "") or "no versions"
            reply.models.add(name=name, state="UNAVAILABLE", reason=reason)


def export_gauges(metrics: Metrics, models: Mapping[str, ServedModel]) -> None:
    """The queue depth, running executions and instances of every model that serves, read when scraped."""
    metrics.gauge(
        "pipeline_queue_depth",
        "Requests waiting now",
        "model",
        lambda: [(n, m.waiting) for n, m in models.items() if m.versions],
    )
    metrics.gauge(
        "pipeline_inflight_batches",
        "Executions running now",
        "model",
        lambda: [(n, m.running) for n, m in models.items() if m.versions],
    )
    metrics.gauge(
        "pipeline_model_instances",
        "Instances loaded, by the runner that runs them (a model service's runner after any fallback, else "
        "the platform) and their device",
        ("model", "version", "runner", "device"),
        lambda: instance_counts(models),
    )


def instance_counts(models: Mapping[str, ServedModel]) -> list[tuple[tuple[str, str, str, str], float]]:
    """How many instances of each served version run on each (runner, device)."""
    counts: Counter[tuple[str, str, str, str]] = Counter()
    for name, model in list(models.items()):
        for version, served in list(model.versions.items()):
            for slot in served.pool.slots:
                runner = getattr(slot.instance, "runner", served.platform)
                counts[(name, version, runner, slot.instance.device)] += 1
    return [(labels, float(count)) for labels, count in counts.items()]

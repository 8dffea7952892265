"""When to add or remove a stage's replicas: the decision every autoscaler here makes, from the routers' own
metrics, with the targets of the Kubernetes HorizontalPodAutoscalers (`deploy/k8s/*.yaml`), so that one
tuning guide serves `pipeline run --autoscale`, the Swarm controller and Kubernetes alike.

The signals, read from the routers' Prometheus endpoints and summed over every router (and router worker):
- the mean time a request waited in the routers' queues for the stage's models since the last look
  (`pipeline_queue_duration_seconds`; the HPA's `pipeline_queue_seconds`, target 50 ms);
- the requests waiting now in those queues (`pipeline_queue_depth`, target 16 per replica);
- the routers' calls in flight to the stage's replicas (`pipeline_stage_inflight_calls`, target 0.9 per
  replica: the routers keep one batch in flight per ready replica, so 0.9 means every replica busy).

A closed loop of clients keeps a replica busy whatever its queue, so the in-flight signal adds replicas
before requests wait (its target 0 leaves it out: scaling on the queue alone). Each signal asks for replicas
as an HPA computes it: the queue time `ceil(replicas * value / target)`, the
other two `ceil(total / per-replica target)`; the largest ask wins, within `[minimum, maximum]`. Up at once
(an HPA's scale-up stabilization of 0); down by one replica at a time, only once every ask of the last
`cooldown` seconds, at half the targets (`DOWN_SHARE`), was lower, and `cooldown` seconds after the last
change (the HPA's scale-down stabilization window and its one-pod policy; the half is a wider tolerance
than the HPA's 10%, so that a stage whose load sits near a target does not flap between two counts). A stage's models are the ones the routers list for it
(`pipeline_stage_model_replicas_ready`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

#: The HPAs' targets (deploy/k8s/model.yaml and the other stages').
QUEUE_SECONDS_TARGET = 0.050
QUEUE_DEPTH_PER_REPLICA = 16.0
INFLIGHT_PER_REPLICA = 0.9
#: The HPAs' scale-down stabilization window, seconds.
COOLDOWN_S = 300.0

#: A replica is removed only where the signals would ask for fewer replicas at this share of their targets.
DOWN_SHARE = 0.5
#: A decision's direction.
UP, DOWN, HOLD = "up", "down", "hold"


@dataclass(frozen=True)
class ScalingTargets:
    """A stage's bounds and targets (see the module docstring)."""

    minimum: int = 1
    maximum: int = 4
    queue_seconds: float = QUEUE_SECONDS_TARGET
    queue_depth_per_replica: float = QUEUE_DEPTH_PER_REPLICA
    inflight_per_replica: float = INFLIGHT_PER_REPLICA
    cooldown: float = COOLDOWN_S

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"replicas: need 1 <= minimum <= maximum, got {self.minimum}..{self.maximum}")


@dataclass(frozen=True)
class Signals:
    """What the routers say of one stage now (see the module docstring); `queue_seconds` is None where no
    request was queued since the last look."""

    queue_seconds: float | None
    queue_depth: float
    inflight: float


@dataclass(frozen=True)
class Decision:
    """How many replicas a stage should have, and why: `direction` up/down/hold, `reason` a short label
    (the signal that asked most, `cooldown` or `bounds`) and `detail` the figures, for the log."""

    replicas: int
    direction: str
    reason: str
    detail: str


def asks(targets: ScalingTargets, signals: Signals, replicas: int, share: float = 1.0) -> dict[str, int]:
    """The replicas each signal asks for, as an HPA computes them, at `share` of each target."""
    wanted = {
        "queue_depth": math.ceil(signals.queue_depth / (targets.queue_depth_per_replica * share)),
    }
    if targets.inflight_per_replica > 0:  # 0: scale on the queue alone
        wanted["inflight"] = math.ceil(signals.inflight / (targets.inflight_per_replica * share))
    if signals.queue_seconds is not None:
        wanted["queue_time"] = math.ceil(replicas * signals.queue_seconds / (targets.queue_seconds * share))
    return wanted


@dataclass
class Autoscaler:
    """One stage's scaling decisions over time: `decide` is called at each look with the signals and the
    time, and remembers what it needs for the cool-down (pure: no clock, no I/O)."""

    targets: ScalingTargets
    #: (time, replicas asked) of the looks within the cool-down.
    _asked: deque[tuple[float, int]] = field(default_factory=deque)
    #: When the replica count last changed, or when the first look was (a replica is removed only after a
    #: whole cool-down of looks).
    _changed_at: float | None = None

    def decide(self, signals: Signals, replicas: int, now: float) -> Decision:
        """The replicas the stage should have now, given `replicas` now (see the module docstring)."""
        targets = self.targets
        if self._changed_at is None:
            self._changed_at = now
        wanted = asks(targets, signals, replicas)
        reason, ask = max(wanted.items(), key=lambda item: (item[1], item[0]))
        bounded = self._bounded(ask)
        # What the signals ask at DOWN_SHARE of the targets: less than the replicas now throughout the
        # window, and one replica fewer still leaves room (a stage does not flap between two counts).
        low_reason, low = max(
            asks(targets, signals, replicas, DOWN_SHARE).items(), key=lambda i: (i[1], i[0])
        )
        keep = max(bounded, self._bounded(low))
        self._asked.append((now, keep))
        while self._asked and self._asked[0][0] < now - targets.cooldown:
            self._asked.popleft()
        detail = _detail(signals, targets, wanted, replicas)
        if bounded > replicas:
            self._changed_at = now
            return Decision(bounded, UP, reason if ask >= bounded else "bounds", detail)
        if replicas > targets.maximum:
            self._changed_at = now
            return Decision(targets.maximum, DOWN, "bounds", detail)
        recent = max(asked for _, asked in self._asked)
        if recent >= replicas:  # needed now, or within the window: the latter waits out the cool-down
            return Decision(replicas, HOLD, reason if keep >= replicas else "cooldown", detail)
        if now - self._changed_at < targets.cooldown:
            return Decision(replicas, HOLD, "cooldown", detail)
        self._changed_at = now
        return Decision(replicas - 1, DOWN, low_reason, detail)

    def _bounded(self, ask: int) -> int:
        return min(max(ask, self.targets.minimum), self.targets.maximum)


def _detail(signals: Signals, targets: ScalingTargets, wanted: Mapping[str, int], replicas: int) -> str:
    queue = "none queued" if signals.queue_seconds is None else f"{signals.queue_seconds * 1000:.1f} ms"
    return (
        f"queue time {queue} (target {targets.queue_seconds * 1000:.0f} ms), queue depth "
        f"{signals.queue_depth:.0f} (target {targets.queue_depth_per_replica:.0f}/replica), in flight "
        f"{signals.inflight:.1f} (target {targets.inflight_per_replica}/replica); {replicas} replica(s), asked "
        + ", ".join(f"{name} {count}" for name, count in sorted(wanted.items()))
    )


@dataclass
class RouterSample:
    """The sums of the routers' metrics at one look, for one stage: queue-time sum and count (counters, so
    the mean since the last look is the change of one over the change of the other), queue depth and calls
    in flight (gauges)."""

    queue_sum: float = 0.0
    queue_count: float = 0.0
    queue_depth: float = 0.0
    inflight: float = 0.0


def stage_samples(texts: Iterable[str], stages: Iterable[str]) -> dict[str, RouterSample]:
    """Each stage's `RouterSample`, summed over the Prometheus expositions of every router in `texts`."""
    samples = {stage: RouterSample() for stage in stages}
    for text in texts:
        families = list(text_string_to_metric_families(text))
        model_stage: dict[str, str] = {}
        for family in families:
            if family.name == "pipeline_stage_model_replicas_ready":
                for sample in family.samples:
                    model_stage[sample.labels["model"]] = sample.labels["stage"]
        for family in families:
            for sample in family.samples:
                labels = sample.labels
                stage = labels.get("stage") or model_stage.get(labels.get("model", ""))
                if stage not in samples:
                    continue
                into = samples[stage]
                if sample.name == "pipeline_queue_duration_seconds_sum":
                    into.queue_sum += sample.value
                elif sample.name == "pipeline_queue_duration_seconds_count":
                    into.queue_count += sample.value
                elif sample.name == "pipeline_queue_depth":
                    into.queue_depth += sample.value
                elif sample.name == "pipeline_stage_inflight_calls":
                    into.inflight += sample.value
    return samples


def signals_between(before: RouterSample | None, now: RouterSample) -> Signals:
    """The signals of a stage from two looks (the first look has no queue time yet); counters that went
    back (a router restarted) count from zero."""
    queue_seconds = None
    if before is not None:
        count = now.queue_count - before.queue_count
        total = now.queue_sum - before.queue_sum
        if count < 0 or total < 0:
            count, total = now.queue_count, now.queue_sum
        if count > 0:
            queue_seconds = total / count
    return Signals(queue_seconds, now.queue_depth, now.inflight)

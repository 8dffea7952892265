"""`pipeline run --autoscale`: a stage's local replica processes between a minimum and a maximum, as the
routers' queue time, queue depth and calls in flight ask (`pipeline.tools.scaling`, the HPAs' signals and
targets).

The router finds a stage's replicas in a file of addresses (`file:PATH`, read every second): a replica that
is added is started, and listed there once its health says SERVING, so the router sends it calls within a
second and never before it can take them; a replica that is removed is unlisted first, then stopped once the
router has stopped choosing it (it drains what it still has, as on any stop). The replicas are supervised as
the others are (restarted where they die). The launcher looks at the router's metrics every `interval`
seconds, logs every change with its reason and figures, and counts every decision in its own metrics
(`pipeline_autoscaler_decisions_total{stage,direction,reason}`, `pipeline_autoscaler_replicas{stage}`),
served on `--autoscale-metrics-port`. Its settings are `Autoscaling`, a group of `pipeline run`'s.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from pydantic import BaseModel

from pipeline.runtime.settings_cli import option
from pipeline.tools.scaling import (
    COOLDOWN_S,
    DOWN,
    HOLD,
    INFLIGHT_PER_REPLICA,
    QUEUE_SECONDS_TARGET,
    UP,
    Autoscaler,
    RouterSample,
    ScalingTargets,
    signals_between,
    stage_samples,
)
from pipeline.tools.supervisor import Service, Supervisor, stop

log = logging.getLogger("pipeline.launcher")

#: Seconds between the router's looks at a stage's file of addresses, with autoscaling.
RESOLVE_INTERVAL_S = 1.0


def autoscale_bounds(text: str) -> dict[str, tuple[int, int]]:
    """`STAGE=MIN:MAX[,...]` -> {stage: (min, max)}."""
    bounds = {}
    for item in filter(None, text.split(",")):
        stage, _, span = item.partition("=")
        low, _, high = span.partition(":")
        if not (stage and low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
            raise argparse.ArgumentTypeError(f"expected STAGE=MIN:MAX with 1 <= MIN <= MAX, got {item!r}")
        bounds[stage] = (int(low), int(high))
    return bounds


class Autoscaling(BaseModel):
    """The autoscaler's settings, `pipeline run`'s `--autoscale*` flags: a stage's local replicas between
    bounds, and the targets they are scaled to."""

    autoscale: Annotated[
        dict[str, tuple[int, int]],
        option(
            "--autoscale",
            parse=autoscale_bounds,
            metavar="STAGE=MIN:MAX[,STAGE=MIN:MAX]",
            help="scale a stage's processes between MIN and MAX replicas on the router's queue time, queue "
            "depth and calls in flight (the Kubernetes HPAs' signals and targets), e.g. model=1:4",
        ),
    ] = {}
    autoscale_queue_ms: Annotated[
        float,
        option(
            "--autoscale-queue-ms",
            parse=float,
            help="target of the mean time requests wait in the router's queues for a stage's models "
            "(default %(default)s, as the HPAs')",
        ),
    ] = QUEUE_SECONDS_TARGET * 1000
    autoscale_inflight: Annotated[
        float,
        option(
            "--autoscale-inflight",
            parse=float,
            help="target of the router's calls in flight per replica of a stage (default %(default)s, as the "
            "HPAs': a replica busy 90%% of the time asks for another); 0 scales on the queue alone",
        ),
    ] = INFLIGHT_PER_REPLICA
    autoscale_cooldown: Annotated[
        float,
        option(
            "--autoscale-cooldown",
            parse=float,
            help="seconds a stage's need must stay lower before a replica is removed, and between removals "
            "(default %(default)s, the HPAs' scale-down stabilization window)",
        ),
    ] = COOLDOWN_S
    autoscale_interval: Annotated[
        float,
        option(
            "--autoscale-interval",
            parse=float,
            help="seconds between looks at the router's metrics (default %(default)s)",
        ),
    ] = 2.0
    autoscale_metrics_port: Annotated[
        int,
        option(
            "--autoscale-metrics-port",
            parse=int,
            help="Prometheus port of the autoscaler's decisions and replica counts (0: one the OS picks; "
            "printed)",
        ),
    ] = 0


@dataclass
class ScaledStage:
    """One autoscaled stage: its decisions, its replicas (listed in `addresses`), those starting and those
    unlisted and about to stop."""

    kind: str
    autoscaler: Autoscaler
    addresses: Path
    serving: list[Service]
    starting: list[Service] = field(default_factory=list)
    #: (service, when it was unlisted).
    leaving: list[tuple[Service, float]] = field(default_factory=list)
    sample: RouterSample | None = None
    #: The reason of the last hold in a row ("" after a change).
    held: str = ""
    #: The number of the next replica started (its name's suffix).
    next_number: int = 1

    @property
    def replicas(self) -> int:
        return len(self.serving) + len(self.starting)


class LocalAutoscaler:
    """Scales `pipeline run`'s stage processes (see the module docstring); `step` is called by the
    supervisor's loop and never blocks for long."""

    def __init__(
        self,
        stages: list[ScaledStage],
        *,
        new_replica: Callable[[str, int], Service],
        supervisor: Supervisor,
        metrics_url: Callable[[], str | None],
        interval: float,
        stop_within: float,
        metrics_port: int | None = 0,
        host: str = "127.0.0.1",
    ) -> None:
        """`new_replica(kind, number)`: a stage process not started yet; `metrics_url()`: the router's
        Prometheus endpoint (None until it listens)."""
        self.stages = {stage.kind: stage for stage in stages}
        self.new_replica = new_replica
        self.supervisor = supervisor
        self.metrics_url = metrics_url
        self.interval = interval
        #: How long a replica that is stopped gets before it is killed (`pipeline.tools.supervisor.stop`).
        self.stop_within = stop_within
        self._next_look = 0.0
        registry = CollectorRegistry()
        self.decisions = Counter(
            "pipeline_autoscaler_decisions",
            "Scaling decisions of pipeline run --autoscale, by stage, direction (up, down, hold) and reason "
            "(the signal that asked most: queue_time, queue_depth, inflight; or cooldown, bounds)",
            ("stage", "direction", "reason"),
            registry=registry,
        )
        self.replica_gauge = Gauge(
            "pipeline_autoscaler_replicas",
            "Replica processes of each autoscaled stage (starting ones included)",
            ("stage",),
            registry=registry,
        )
        for stage in stages:
            self.replica_gauge.labels(stage.kind).set_function(_count_of(stage))
            write_addresses(stage.addresses, stage.serving, supervisor.connect)
        self.metrics_server_port: int | None = None
        if metrics_port is not None:
            server, _ = start_http_server(metrics_port, addr=host, registry=registry)
            self.metrics_server_port = server.server_port

    def step(self, now: float) -> None:
        for stage in self.stages.values():
            self._follow_starting(stage)
            self._stop_left(stage, now)
        if now >= self._next_look:
            self._next_look = now + self.interval
            self._look(now)

    def _look(self, now: float) -> None:
        url = self.metrics_url()
        if url is None:
            return
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                text = reply.read().decode()
        except OSError as err:
            log.warning("autoscaler: cannot read the router's metrics at %s: %s", url, err)
            return
        samples = stage_samples([text], self.stages)
        for kind, stage in self.stages.items():
            sample = samples[kind]
            signals = signals_between(stage.sample, sample)
            stage.sample = sample
            decision = stage.autoscaler.decide(signals, stage.replicas, now)
            self.decisions.labels(kind, decision.direction, decision.reason).inc()
            if decision.direction == HOLD:
                # Every hold is counted; logged where its reason changes (a cool-down begins, say).
                changed = stage.held != decision.reason
                stage.held = decision.reason
                (log.info if changed else log.debug)(
                    "autoscaler: %s holds at %d (%s): %s",
                    kind,
                    stage.replicas,
                    decision.reason,
                    decision.detail,
                )
                continue
            stage.held = ""
            log.info(
                "autoscaler: %s %s from %d to %d replica(s), reason %s: %s",
                kind,
                "scales up" if decision.direction == UP else "scales down",
                stage.replicas,
                decision.replicas,
                decision.reason,
                decision.detail,
            )
            if decision.direction == UP:
                for _ in range(decision.replicas - stage.replicas):
                    self._add(stage)
            elif decision.direction == DOWN:
                for _ in range(stage.replicas - decision.replicas):
                    self._remove(stage, now)

    def _add(self, stage: ScaledStage) -> None:
        service = self.new_replica(stage.kind, stage.next_number)
        stage.next_number += 1
        sup = self.supervisor
        service.start(sup.host, sup.ports / service.name)
        stage.starting.append(service)
        log.info(
            "autoscaler: %s started (pid %s), listed for the router once it serves", service.name, service.pid
        )

    def _follow_starting(self, stage: ScaledStage) -> None:
        sup = self.supervisor
        for service in list(stage.starting):
            code = service.exit_code()
            if code is not None:
                stage.starting.remove(service)
                log.error(
                    "autoscaler: %s exited with code %s while starting (see its log above)",
                    service.name,
                    code,
                )
                continue
            port_file = sup.ports / service.name
            if not port_file.exists():
                continue
            service.port = int(port_file.read_text())
            if not _serving(f"{sup.connect}:{service.port}", sup.credentials):
                continue
            stage.starting.remove(service)
            stage.serving.append(service)
            sup.add(service)
            write_addresses(stage.addresses, stage.serving, sup.connect)
            log.info("autoscaler: %s serves on port %d: listed for the router", service.name, service.port)

    def _remove(self, stage: ScaledStage, now: float) -> None:
        """Unlist the newest replica (a starting one first); it stops once the router no longer picks it."""
        if stage.starting:
            service = stage.starting.pop()
            threading.Thread(target=stop, args=([service], self.stop_within), daemon=True).start()
            return
        service = stage.serving.pop()
        self.supervisor.remove(service)
        write_addresses(stage.addresses, stage.serving, self.supervisor.connect)
        stage.leaving.append((service, now))
        log.info("autoscaler: %s unlisted; it stops once the router has let it go", service.name)

    def _stop_left(self, stage: ScaledStage, now: float) -> None:
        # The router reads the file every RESOLVE_INTERVAL_S: after two reads, no new call goes there.
        for service, since in list(stage.leaving):
            if now - since >= 2 * RESOLVE_INTERVAL_S + 0.5:
                stage.leaving.remove((service, since))
                threading.Thread(target=self._stop, args=(service,), daemon=True).start()

    def _stop(self, service: Service) -> None:
        stop([service], self.stop_within)
        log.info("autoscaler: %s stopped", service.name)

    def close(self) -> None:
        """Stop the replicas still leaving (the pipeline is stopping)."""
        stop([service for stage in self.stages.values() for service, _ in stage.leaving], self.stop_within)
        stop([service for stage in self.stages.values() for service in stage.starting], self.stop_within)


def _count_of(stage: ScaledStage) -> Callable[[], float]:
    return lambda: float(stage.replicas)


def write_addresses(path: Path, services: list[Service], connect: str) -> None:
    """The file the router reads a stage's replicas from: written whole, then renamed over the old one."""
    partial = path.with_name(path.name + ".new")
    partial.write_text("".join(f"{connect}:{service.port}\n" for service in services))
    os.replace(partial, path)


def _serving(address: str, credentials: grpc.ChannelCredentials | None) -> bool:
    channel = (
        grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    )
    with channel:
        try:
            # The stubs (types-grpcio-health-checking) declare HealthStub without its methods.
            reply = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=""), timeout=0.5
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def scaled_stage(
    kind: str, bounds: tuple[int, int], settings: Autoscaling, addresses: Path, serving: list[Service]
) -> ScaledStage:
    """An autoscaled stage as `pipeline run`'s settings say, its first replicas `serving`."""
    targets = ScalingTargets(
        minimum=bounds[0],
        maximum=bounds[1],
        queue_seconds=settings.autoscale_queue_ms / 1000,
        inflight_per_replica=settings.autoscale_inflight,
        cooldown=settings.autoscale_cooldown,
    )
    return ScaledStage(kind, Autoscaler(targets), addresses, serving, next_number=len(serving) + 1)

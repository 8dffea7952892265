"""The autoscaler of a Docker Swarm stack: what `docker service scale` does by hand, from the routers' queue
time, queue depth and calls in flight (`pipeline.tools.scaling`: the HPAs' signals, targets and decision).

    python -m pipeline.tools.swarm_autoscaler --service model=pipeline_model:1:4 [--service ...]
        [--routers tasks.router:8002] [--interval 15] [--cooldown 300] [--queue-ms 50] [--metrics-port 8003]

Every `interval` seconds it reads the Prometheus endpoint of every router task (`tasks.<service>` resolves
to each task's address on a stack's network), sums them per stage, decides each service's replicas, and
sets the ones that changed through the Docker Engine API on the manager's socket (the request `docker service
scale` sends: the service's spec with its replica count changed, at its current version). Every decision is
logged and counted (`pipeline_autoscaler_decisions_total{stage,direction,reason}`), and each service's
replicas exported (`pipeline_autoscaler_replicas{stage}`) on `--metrics-port`. It runs as the `autoscaler`
service of `compose.swarm.yaml`, on a manager node.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from pydantic import BaseModel, Field

from pipeline.runtime.settings_cli import add_arguments, option, process_settings
from pipeline.tools.scaling import (
    COOLDOWN_S,
    HOLD,
    INFLIGHT_PER_REPLICA,
    QUEUE_SECONDS_TARGET,
    Autoscaler,
    Decision,
    RouterSample,
    ScalingTargets,
    signals_between,
    stage_samples,
)

log = logging.getLogger("pipeline.swarm_autoscaler")

DOCKER_SOCKET = "/var/run/docker.sock"


class DockerError(RuntimeError):
    """The Docker Engine API refused a request; the message carries its answer."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


class DockerServices:
    """The two Docker Engine API calls the controller makes: a service's replicas, and setting them."""

    def __init__(self, socket_path: str = DOCKER_SOCKET, timeout: float = 10.0) -> None:
        self.socket_path, self.timeout = socket_path, timeout

    def _request(self, method: str, path: str, body: object | None = None) -> Any:
        connection = _UnixConnection(self.socket_path, self.timeout)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            connection.request(method, path, body=payload, headers=headers)
            reply = connection.getresponse()
            text = reply.read().decode(errors="replace")
        finally:
            connection.close()
        if reply.status >= 300:
            raise DockerError(f"{method} {path}: {reply.status} {text.strip()}")
        return json.loads(text) if text.strip() else None

    def inspect(self, service: str) -> dict[str, Any]:
        found: dict[str, Any] = self._request("GET", f"/services/{urllib.parse.quote(service)}")
        return found

    def replicas(self, service: str) -> int:
        return int(self.inspect(service)["Spec"]["Mode"]["Replicated"]["Replicas"])

    def scale(self, service: str, replicas: int) -> None:
        """What `docker service scale SERVICE=N` does: the spec again, its replica count changed, at the
        version read (a concurrent change makes Docker refuse it, and the next look tries again)."""
        current = self.inspect(service)
        spec = current["Spec"]
        spec["Mode"]["Replicated"]["Replicas"] = replicas
        version = current["Version"]["Index"]
        self._request("POST", f"/services/{current['ID']}/update?version={version}", spec)


@dataclass
class ScaledService:
    """One stage's Swarm service and its decisions."""

    stage: str
    service: str
    autoscaler: Autoscaler
    sample: RouterSample | None = field(default=None)
    #: The reason of the last hold in a row ("" after a change).
    held: str = ""


def router_texts(routers: str, fetch: Callable[[str], str] | None = None) -> list[str]:
    """The Prometheus expositions of every router task: `host:port`, its host resolved to every address."""
    host, _, port = routers.rpartition(":")
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = sorted({str(info[4][0]) for info in infos})
    read = fetch or _fetch
    texts = []
    for address in addresses:
        where = f"[{address}]" if ":" in address else address
        try:
            texts.append(read(f"http://{where}:{port}/metrics"))
        except OSError as err:
            log.warning("router %s:%s: no metrics: %s", address, port, err)
    return texts


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return str(reply.read().decode())


def step(
    services: Iterable[ScaledService], texts: list[str], replicas: Mapping[str, int], now: float
) -> dict[str, Decision]:
    """Each service's decision from the routers' metrics and its replicas now (no I/O)."""
    services = list(services)
    samples = stage_samples(texts, [s.stage for s in services])
    decisions = {}
    for scaled in services:
        sample = samples[scaled.stage]
        signals = signals_between(scaled.sample, sample)
        scaled.sample = sample
        decisions[scaled.service] = scaled.autoscaler.decide(signals, replicas[scaled.service], now)
    return decisions


class SwarmAutoscaler:
    """The controller's loop: read, decide, scale, count."""

    def __init__(
        self,
        services: list[ScaledService],
        docker: DockerServices,
        routers: str,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.services, self.docker, self.routers = services, docker, routers
        self.registry = registry or CollectorRegistry()
        self.decisions = Counter(
            "pipeline_autoscaler_decisions",
            "Scaling decisions, by stage, direction (up, down, hold) and reason (the signal that asked most: "
            "queue_time, queue_depth, inflight; or cooldown, bounds)",
            ("stage", "direction", "reason"),
            registry=self.registry,
        )
        self.replicas = Gauge(
            "pipeline_autoscaler_replicas",
            "Replicas of each autoscaled stage",
            ("stage",),
            registry=self.registry,
        )

    def look(self, now: float, texts: list[str] | None = None) -> dict[str, Decision]:
        texts = router_texts(self.routers) if texts is None else texts
        current = {s.service: self.docker.replicas(s.service) for s in self.services}
        decisions = step(self.services, texts, current, now)
        for scaled in self.services:
            decision = decisions[scaled.service]
            self.decisions.labels(scaled.stage, decision.direction, decision.reason).inc()
            self.replicas.labels(scaled.stage).set(current[scaled.service])
            if decision.direction == HOLD:
                # Every hold is counted; logged where its reason changes (a cool-down begins, say).
                changed = scaled.held != decision.reason
                scaled.held = decision.reason
                (log.info if changed else log.debug)(
                    "%s holds at %d (%s): %s",
                    scaled.service,
                    decision.replicas,
                    decision.reason,
                    decision.detail,
                )
                continue
            scaled.held = ""
            log.info(
                "%s: scale %s from %d to %d, reason %s: %s",
                scaled.service,
                decision.direction,
                current[scaled.service],
                decision.replicas,
                decision.reason,
                decision.detail,
            )
            self.docker.scale(scaled.service, decision.replicas)
            self.replicas.labels(scaled.stage).set(decision.replicas)
        return decisions

    def run(self, interval: float) -> None:
        while True:
            try:
                self.look(time.monotonic())
            except (OSError, DockerError, KeyError, ValueError) as err:
                log.error("autoscaler: this look failed, the next one tries again: %s", err)
            time.sleep(interval)


def service_argument(text: str) -> tuple[str, str, int, int, float | None]:
    """`STAGE=SERVICE:MIN:MAX[:QUEUE_MS]` -> (stage, service, min, max, queue-time target in ms or None)."""
    stage, _, rest = text.partition("=")
    service, *numbers = rest.split(":")
    wrong = argparse.ArgumentTypeError(f"expected STAGE=SERVICE:MIN:MAX[:QUEUE_MS], got {text!r}")
    if not stage or not service or len(numbers) not in (2, 3):
        raise wrong
    try:
        low, high = int(numbers[0]), int(numbers[1])
        queue_ms = float(numbers[2]) if len(numbers) == 3 else None
    except ValueError:
        raise wrong from None
    if low < 0 or high < 0 or (queue_ms is not None and queue_ms <= 0):
        raise wrong
    return stage, service, low, high, queue_ms


def _services(text: str) -> list[tuple[str, str, int, int, float | None]]:
    """`PIPELINE_AUTOSCALER_SERVICES`: `--service` values, comma-separated."""
    return [service_argument(item.strip()) for item in text.split(",") if item.strip()]


class SwarmScaling(BaseModel):
    """What the Swarm autoscaler scales, on what, and how often; each setting from its flag, else its
    `PIPELINE_AUTOSCALER_*` variable, else the default."""

    service: Annotated[
        list[tuple[str, str, int, int, float | None]],
        option(
            "--service",
            env="PIPELINE_AUTOSCALER_SERVICES",
            parse=service_argument,
            env_parse=_services,
            action="append",
            metavar="STAGE=SERVICE:MIN:MAX[:QUEUE_MS]",
            help="a stage (as the routers name it) and its Swarm service, scaled between MIN and MAX, with its "
            "own queue-time target in ms where given (else --queue-ms) (repeatable; env "
            "PIPELINE_AUTOSCALER_SERVICES, comma-separated)",
        ),
    ] = []
    routers: Annotated[
        str,
        option(
            "--routers",
            env="PIPELINE_AUTOSCALER_ROUTERS",
            help="every router task's metrics: HOST:PORT (env PIPELINE_AUTOSCALER_ROUTERS; default %(default)s)",
        ),
    ] = "tasks.router:8002"
    interval: Annotated[
        float,
        Field(gt=0),
        option(
            "--interval",
            env="PIPELINE_AUTOSCALER_INTERVAL",
            parse=float,
            help="seconds between looks (env PIPELINE_AUTOSCALER_INTERVAL; default %(default)s)",
        ),
    ] = 15.0
    cooldown: Annotated[
        float,
        option(
            "--cooldown",
            env="PIPELINE_AUTOSCALER_COOLDOWN",
            parse=float,
            help="scale-down cool-down, seconds (env PIPELINE_AUTOSCALER_COOLDOWN; default %(default)s)",
        ),
    ] = COOLDOWN_S
    queue_ms: Annotated[
        float,
        option(
            "--queue-ms",
            env="PIPELINE_AUTOSCALER_QUEUE_MS",
            parse=float,
            help="queue-time target of the services that name none, ms (env PIPELINE_AUTOSCALER_QUEUE_MS; "
            "default %(default)s)",
        ),
    ] = QUEUE_SECONDS_TARGET * 1000
    inflight: Annotated[
        float,
        option(
            "--inflight",
            env="PIPELINE_AUTOSCALER_INFLIGHT",
            parse=float,
            help="calls-in-flight target per replica (0: scale on the queue alone; env "
            "PIPELINE_AUTOSCALER_INFLIGHT; default %(default)s)",
        ),
    ] = INFLIGHT_PER_REPLICA
    metrics_port: Annotated[
        int,
        option(
            "--metrics-port",
            env="PIPELINE_AUTOSCALER_METRICS_PORT",
            parse=int,
            help="Prometheus port of its decisions (env PIPELINE_AUTOSCALER_METRICS_PORT; default %(default)s)",
        ),
    ] = 8003
    docker_socket: Annotated[
        str,
        option(
            "--docker-socket",
            env="PIPELINE_AUTOSCALER_DOCKER_SOCKET",
            help="the Docker Engine's socket on a manager node (env PIPELINE_AUTOSCALER_DOCKER_SOCKET; default "
            "%(default)s)",
        ),
    ] = DOCKER_SOCKET


#: `python -m pipeline.tools.swarm_autoscaler`.
SwarmAutoscalerSettings = process_settings("SwarmAutoscalerSettings", (SwarmScaling,))


def scaled_services(settings: SwarmScaling) -> list[ScaledService]:
    """Each `--service` with its autoscaler: its own bounds and queue-time target (else `--queue-ms`), the
    in-flight target and cool-down every service shares."""
    return [
        ScaledService(
            stage,
            service,
            Autoscaler(
                ScalingTargets(
                    low,
                    high,
                    queue_seconds=(settings.queue_ms if queue_ms is None else queue_ms) / 1000,
                    inflight_per_replica=settings.inflight,
                    cooldown=settings.cooldown,
                )
            ),
        )
        for stage, service, low, high, queue_ms in settings.service
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, SwarmAutoscalerSettings)
    settings = SwarmAutoscalerSettings.parse(parser, argv).group(SwarmScaling)
    if not settings.service:
        parser.error(
            "name a service to scale: --service STAGE=SERVICE:MIN:MAX (or PIPELINE_AUTOSCALER_SERVICES)"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s autoscaler %(levelname)s: %(message)s")
    services = scaled_services(settings)
    controller = SwarmAutoscaler(services, DockerServices(settings.docker_socket), settings.routers)
    start_http_server(settings.metrics_port, registry=controller.registry)
    log.info(
        "scaling %s on the metrics of %s every %.0f s",
        ", ".join(f"{s.service} ({s.stage})" for s in services),
        settings.routers,
        settings.interval,
    )
    controller.run(settings.interval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The processes of `pipeline run` and their supervision: each one's output, its restarts, when to give up.

A process that dies is started again on the ports it had bound, so the router (and every client) finds it
where it was. It waits first, longer after each death in a row: 0.5 s, 1 s, 2 s, … at most 30 s, and the
shortest again once the process has served for a minute. The others keep serving meanwhile: the router
routes around a stage replica that is down and takes it back once its health says SERVING. A process that
keeps dying, `RestartPolicy.limit` deaths within `RestartPolicy.window` seconds, is given up on: the
supervisor names it, shows its last lines of output and stops the pipeline, since a fault that restarts do
not cure is better reported than hidden.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeline.runtime.shutdown import child_environment, exit_deadline

log = logging.getLogger("pipeline.launcher")

#: Lines of each process's output kept to show when it is given up on.
TAIL_LINES = 20
#: One writer at a time on the launcher's output, so that the processes' lines do not interleave.
_OUTPUT = threading.Lock()
#: How long past its own bound of a stop a service that has not exited is given before it is SIGKILLed.
KILL_MARGIN_S = 5.0


@dataclass(frozen=True)
class RestartPolicy:
    """When a process that died is started again (see the module docstring)."""

    #: The death that stops the pipeline: the `limit`-th within `window` seconds (1: the first death).
    limit: int = 5
    window: float = 120.0
    #: The wait before the first restart; it doubles with each death in a row, up to `max_delay`.
    first_delay: float = 0.5
    max_delay: float = 30.0
    #: A process that had served this long when it died counts as healthy again: its next wait is the first.
    reset_after: float = 60.0


class RestartRecord:
    """One process's deaths, and the wait before it starts again."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.deaths: deque[float] = deque()
        self.in_a_row = 0
        #: When the process is to start again (None: it runs, or is not to start again).
        self.restart_at: float | None = None
        self.died_at = 0.0

    def died(self, now: float, served: float) -> float | None:
        """A death at `now`, after `served` seconds up: the wait before the restart, or None when this death
        is the policy's `limit`-th within its window (give up)."""
        policy = self.policy
        self.died_at = now
        self.deaths.append(now)
        while now - self.deaths[0] > policy.window:
            self.deaths.popleft()
        if len(self.deaths) >= policy.limit:
            return None
        self.in_a_row = 1 if served >= policy.reset_after else self.in_a_row + 1
        delay = min(policy.first_delay * 2 ** (self.in_a_row - 1), policy.max_delay)
        self.restart_at = now + delay
        return delay


@dataclass
class Service:
    """One process of the pipeline: its command line, the port it serves, and its last lines of output."""

    name: str
    command: list[str]
    port: int
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    #: The latest lines it wrote (stdout and stderr), without their line ends.
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    #: `time.monotonic()` when it was last started.
    started_at: float = 0.0

    def start(self, host: str, port_file: Path) -> None:
        """Start the process; it writes the ports it binds to `port_file` (and `<port_file>.metrics`)."""
        port_file.unlink(missing_ok=True)
        metrics_file(port_file).unlink(missing_ok=True)
        command = [sys.executable, *self.command, "--host", host, "--port", str(self.port), *self.args]
        command += ["--port-file", str(port_file), "--metrics-port-file", str(metrics_file(port_file))]
        # NOTE: a session of its own, so Ctrl-C in the terminal reaches only the launcher, which then stops
        # the services in order instead of all at once; and whatever the process leaves behind when it dies
        # (router workers) is in its process group, to be stopped with it. Out of the launcher's session, it
        # still ends with the launcher, killed or not (`child_environment`): Linux signals it when the thread
        # that started it ends, so services are started from the launcher's main thread only.
        self.process = subprocess.Popen(
            command,
            env=child_environment({**os.environ, **self.env}),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.started_at = time.monotonic()
        assert self.process.stdout is not None
        threading.Thread(
            target=self._relay, args=(self.process.stdout,), name=f"{self.name} output", daemon=True
        ).start()

    def _relay(self, stream: IO[bytes]) -> None:
        """Copy the process's output to the launcher's, line by line, keeping the last lines."""
        out = getattr(sys.stdout, "buffer", None)
        with stream:
            for line in stream:
                with _OUTPUT:
                    if out is not None:
                        out.write(line)
                        out.flush()
                    else:
                        sys.stdout.write(line.decode(errors="replace"))
                self.tail.append(line.decode(errors="replace").rstrip("\r\n"))

    def pin(self, flag: str, value: str) -> None:
        """Start with `flag value` from now on (the port a first start bound, kept for the restarts)."""
        if flag in self.args:
            self.args[self.args.index(flag) + 1] = value
        else:
            self.args += [flag, value]

    def wait_port(self, port_file: Path, timeout: float) -> int:
        """The port the service bound (the one asked for, or the OS's pick for port 0)."""
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            code = self.exit_code()
            if code is not None:
                raise RuntimeError(f"{self.name} exited with code {code} while starting (see its log above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start listening within {timeout:.0f}s")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        return self.port

    def metrics_port(self, port_file: Path) -> int | None:
        """The port of the service's Prometheus endpoint, once it listens (None: it serves none)."""
        path = metrics_file(port_file)
        return int(path.read_text()) if path.exists() else None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill_leftovers(self) -> None:
        """SIGKILL the process's group: what a dead process left there (the workers of a router), and the
        process too where it still runs."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)


def metrics_file(port_file: Path) -> Path:
    """Where a service started with `port_file` writes the port of its Prometheus endpoint."""
    return port_file.with_name(port_file.name + ".metrics")


def describe_exit(code: int) -> str:
    """`code 3`, or `code -9 (SIGKILL)` for a process a signal ended."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code} ({signal.Signals(-code).name})"
    return f"code {code}"


def wait_healthy(
    service: Service, address: str, timeout: float, credentials: grpc.ChannelCredentials | None = None
) -> None:
    """Wait until a service's health check says SERVING; fail if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    channel = (
        grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    )
    process = service.process
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            code = None if process is None else process.poll()
            if code is not None:
                raise RuntimeError(
                    f"{service.name} exited with {describe_exit(code)} while starting (see its log above)"
                )
            try:
                # The stubs (types-grpcio-health-checking) declare HealthStub without its methods.
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)  # type: ignore[attr-defined]
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{service.name} did not become healthy at {address} within {timeout:.0f}s"
                )
            time.sleep(0.2)


def stop_within(grace: float, drain_delay: float) -> float:
    """How long a service gets after SIGTERM before the launcher SIGKILLs it: its own bound (`drain_delay`,
    `grace` and `EXIT_MARGIN_S`, `pipeline.runtime.shutdown.exit_deadline`) and `KILL_MARGIN_S`."""
    return exit_deadline(drain_delay, grace) + KILL_MARGIN_S


def stop(services: Iterable[Service], within: float) -> None:
    """SIGTERM every running service at once and wait for them; SIGKILL what still runs `within` seconds
    later, with its process group (a router's workers)."""
    running = [s for s in services if s.process is not None and s.process.poll() is None]
    for service in running:
        assert service.process is not None
        service.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + within
    for service in running:
        assert service.process is not None
        try:
            service.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning(
                "%s (pid %s) did not stop within %.0fs; killing it", service.name, service.pid, within
            )
            service.kill_leftovers()
            service.process.wait()


class Supervisor:
    """Keeps the pipeline's processes running: restarts those that die, gives up on one that keeps dying."""

    def __init__(
        self,
        services: Iterable[Service],
        policy: RestartPolicy,
        *,
        host: str,
        connect: str,
        ports: Path,
        startup_timeout: float,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """`host`: where the services bind, `connect`: where the launcher reaches them; `ports`: the folder
        of their port files; `credentials`: those of the launcher's own health checks."""
        self.services = list(services)
        self.policy = policy
        self.host, self.connect, self.ports = host, connect, ports
        self.startup_timeout = startup_timeout
        self.credentials = credentials
        self.records = {service.name: RestartRecord(policy) for service in self.services}

    def add(self, service: Service) -> None:
        """Supervise a process started later (a replica the autoscaler added)."""
        self.services.append(service)
        self.records[service.name] = RestartRecord(self.policy)

    def remove(self, service: Service) -> None:
        """Stop supervising a process about to be stopped on purpose (a replica the autoscaler removes)."""
        self.services.remove(service)
        self.records.pop(service.name, None)

    def run(
        self, stopping: Callable[[], bool], interval: float = 0.1, tick: Callable[[float], None] | None = None
    ) -> int:
        """Supervise until `stopping()` says so (0), or until a process keeps dying (1); `tick(now)` is called
        at each turn (the autoscaler's)."""
        while not stopping():
            now = time.monotonic()
            if tick is not None:
                tick(now)
            for service in list(self.services):
                record = self.records[service.name]
                if record.restart_at is not None:
                    if now >= record.restart_at:
                        self._restart(service, record)
                    continue
                code = service.exit_code()
                if code is not None and not self._died(service, record, code, now):
                    return 1
            time.sleep(interval)
        return 0

    def _died(self, service: Service, record: RestartRecord, code: int, now: float) -> bool:
        """Note a death; False when the process is given up on (the pipeline stops)."""
        served = now - service.started_at
        delay = record.died(now, served)
        policy = self.policy
        if delay is None:
            lines = "\n".join(f"  {line}" for line in service.tail) or "  (no output)"
            log.error(
                "%s (pid %s) exited with %s: %d deaths within %.0fs (--restart-limit %d, --restart-window "
                "%.0f), so it is not started again; stopping the pipeline. Its last lines of output:\n%s",
                service.name,
                service.pid,
                describe_exit(code),
                len(record.deaths),
                policy.window,
                policy.limit,
                policy.window,
                lines,
            )
            return False
        log.warning(
            "%s (pid %s) exited with %s after %.1fs; starting it again in %.1fs (death %d of %d within %.0fs "
            "stops the pipeline); the others keep serving",
            service.name,
            service.pid,
            describe_exit(code),
            served,
            delay,
            len(record.deaths),
            policy.limit,
            policy.window,
        )
        return True

    def _restart(self, service: Service, record: RestartRecord) -> None:
        record.restart_at = None
        service.kill_leftovers()
        service.start(self.host, self.ports / service.name)
        log.info("%s started again (pid %s) on port %d", service.name, service.pid, service.port)
        threading.Thread(
            target=self._report_serving,
            args=(service, record.died_at),
            name=f"{service.name} health",
            daemon=True,
        ).start()

    def _report_serving(self, service: Service, died_at: float) -> None:
        """Say when a restarted process serves again (it may die first: its next death is the loop's)."""
        try:
            wait_healthy(service, f"{self.connect}:{service.port}", self.startup_timeout, self.credentials)
        except RuntimeError:
            return
        log.info(
            "%s (pid %s) is serving again, %.1fs after it died",
            service.name,
            service.pid,
            time.monotonic() - died_at,
        )

"""Several router processes on one port (`pipeline router --workers N`), and their one view of metrics and
statistics.

The parent starts N router processes that listen on the same gRPC and HTTP ports with `SO_REUSEPORT`: the
kernel hands each new connection to one of them, and each batches its own share of the calls. The parent
serves no request; it forwards SIGTERM/SIGINT, and serves the router's Prometheus port with every worker's
metrics, each sample labelled `worker`.

`ModelStatistics` lands on one worker, which must answer for all: every worker also serves its own figures
on a Unix socket in a folder private to the router's user (`pipeline.RouterWorker/Statistics`, and
`CacheHits`: what its response cache answered for stage models, whose other figures come from their
stages), and the worker that is asked sums its peers' figures with its own.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.router.front import DOOR_FILE_ENV, LOOPBACK, SECRET_ENV, FrontProcess
from pipeline.runtime.model_statistics import add_statistics
from pipeline.runtime.router_settings import Http, RouterOptions
from pipeline.runtime.server import write_port
from pipeline.runtime.server_settings import Listening
from pipeline.runtime.settings_cli import ProcessSettings
from pipeline.runtime.shutdown import child_environment

log = logging.getLogger(__name__)

#: The folder the workers share, and each one's index: set by the parent in each worker's environment.
WORKER_DIR_ENV = "PIPELINE_ROUTER_WORKER_DIR"
WORKER_INDEX_ENV = "PIPELINE_ROUTER_WORKER"

STATISTICS_METHOD = "/pipeline.RouterWorker/Statistics"
CACHE_HITS_METHOD = "/pipeline.RouterWorker/CacheHits"

#: A worker's own figures: `(name, version)` -> its `ModelStatistics` answer.
LocalStatistics = Callable[[str, str], Awaitable[pb.ModelStatisticsResponse]]


def socket_path(folder: Path, index: int) -> Path:
    return folder / f"worker-{index}.sock"


# --- inside a worker -----------------------------------------------------------------------------------


class WorkerPeers:
    """A worker's side of the shared view: serves its own statistics on its socket, asks the others for
    theirs."""

    def __init__(self, folder: Path, index: int) -> None:
        self.folder, self.index = folder, index
        self._server: grpc.aio.Server | None = None

    @classmethod
    def from_env(cls) -> WorkerPeers | None:
        folder = os.environ.get(WORKER_DIR_ENV)
        if not folder:
            return None
        return cls(Path(folder), int(os.environ.get(WORKER_INDEX_ENV, "0")))

    async def start(self, local_statistics: LocalStatistics, local_cache_hits: LocalStatistics) -> None:
        """Serve `local_statistics(name, version)` (this worker's own figures) and `local_cache_hits(name,
        version)` (what its response cache answered for stage models) on this worker's socket."""

        def method(answer: LocalStatistics) -> grpc.RpcMethodHandler:
            async def handle(request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext):
                return await answer(request.name, request.version)

            return grpc.unary_unary_rpc_method_handler(
                handle,
                request_deserializer=pb.ModelStatisticsRequest.FromString,
                response_serializer=pb.ModelStatisticsResponse.SerializeToString,
            )

        handler = grpc.method_handlers_generic_handler(
            "pipeline.RouterWorker",
            {"Statistics": method(local_statistics), "CacheHits": method(local_cache_hits)},
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        path = socket_path(self.folder, self.index)
        path.unlink(missing_ok=True)
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        self._server = server

    async def peer_statistics(
        self, name: str, version: str, *, cache_hits: bool = False
    ) -> list[pb.ModelStatisticsResponse]:
        """The other workers' own figures, or (`cache_hits`) what their response caches answered for stage
        models; a worker that cannot answer now is left out, and logged."""
        method = CACHE_HITS_METHOD if cache_hits else STATISTICS_METHOD
        replies = []
        for path in sorted(self.folder.glob("worker-*.sock")):
            if path == socket_path(self.folder, self.index):
                continue
            async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
                call = channel.unary_unary(
                    method,
                    request_serializer=pb.ModelStatisticsRequest.SerializeToString,
                    response_deserializer=pb.ModelStatisticsResponse.FromString,
                )
                try:
                    replies.append(
                        await call(pb.ModelStatisticsRequest(name=name, version=version), timeout=2)
                    )
                except grpc.aio.AioRpcError as err:
                    log.warning("router worker %s did not give its statistics: %s", path.stem, err.details())
        return replies

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
        socket_path(self.folder, self.index).unlink(missing_ok=True)


def merge_statistics(replies: Sequence[pb.ModelStatisticsResponse]) -> pb.ModelStatisticsResponse:
    """Several processes' `ModelStatistics` as one: each model's figures summed (`add_statistics`) per
    version, in the first reply's model order."""
    merged: dict[tuple[str, str], pb.ModelStatistics] = {}
    for reply in replies:
        for stats in reply.model_stats:
            key = (stats.name, stats.version)
            into = merged.get(key)
            if into is None:
                merged[key] = into = pb.ModelStatistics()
                into.CopyFrom(stats)
            else:
                add_statistics(into, stats)
    return pb.ModelStatisticsResponse(model_stats=list(merged.values()))


# --- the parent ----------------------------------------------------------------------------------------


class WorkerMetrics(Collector):
    """Every worker's metrics, read from its own /metrics when Prometheus scrapes the parent, each sample
    labelled `worker` (sum them `without (worker)` for the router as a whole)."""

    def __init__(self, folder: Path, workers: int) -> None:
        self.folder, self.workers = folder, workers

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for index in range(self.workers):
            port_file = self.folder / f"worker-{index}.metrics"
            try:
                port = int(port_file.read_text())
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
                    text = reply.read().decode()
            except (OSError, ValueError) as err:
                log.warning("router worker %d has no metrics to give: %s", index, err)
                continue
            for family in text_string_to_metric_families(text):
                into = families.get(family.name)
                if into is None:
                    into = families[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "worker": str(index)}, sample.value)
        return list(families.values())

    def describe(self) -> Iterable[Metric]:
        return []


def _reserve(host: str, port: int) -> socket.socket:
    """Bind (without listening) to pick a port every worker then shares through SO_REUSEPORT; a bound
    socket that does not listen takes no connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _wait_listening(folder: Path, children: list[subprocess.Popen], http: bool, doors: bool) -> bool:
    """Wait until every worker has written its port files (it listens; `doors`: its door too); False if one
    exits first."""
    names = [f"worker-{i}.port" for i in range(len(children))]
    if http:
        names += [f"worker-{i}.http-port" for i in range(len(children))]
    if doors:
        names += [f"worker-{i}.door" for i in range(len(children))]
    while not all((folder / name).exists() for name in names):
        if any(child.poll() is not None for child in children):
            return False
        time.sleep(0.05)
    return True


def _serve_metrics(listening: Listening, workers: int, folder: Path) -> WSGIServer | None:
    """Serve every worker's metrics on the router's Prometheus port (`--metrics-port`), if it has one; None
    when it has none or it cannot be served (logged: the router serves without them)."""
    if listening.metrics_port is None:
        return None
    registry = CollectorRegistry()
    registry.register(WorkerMetrics(folder, workers))
    server = None
    try:
        server, _ = start_http_server(listening.metrics_port, addr=listening.host, registry=registry)
        write_port(listening.metrics_port_file, server.server_port)
    except OSError as err:
        log.error(
            "cannot serve metrics on %s:%d: %s; serving without them",
            listening.host,
            listening.metrics_port,
            err,
        )
    return server


def _start_workers(
    workers: int, folder: Path, argv: Sequence[str], front: FrontProcess | None
) -> list[subprocess.Popen]:
    """Start `workers` router processes running the command line `argv`, each with its index, the shared
    `folder`, and port files of its own (behind a `front`, its door's too)."""
    children = []
    for index in range(workers):
        # A worker ends with the router's parent process, killed or not (`pipeline.runtime.shutdown`).
        env = child_environment({**os.environ, WORKER_DIR_ENV: str(folder), WORKER_INDEX_ENV: str(index)})
        if front is not None:
            env.update({SECRET_ENV: front.secret, DOOR_FILE_ENV: str(folder / f"worker-{index}.door")})
        metrics = ["--metrics-port", "0", "--metrics-port-file", str(folder / f"worker-{index}.metrics")]
        # Each worker says where it listens in a file of its own; the parent writes the router's port files
        # once every worker listens, so that no client connects while only some of them take connections.
        ports = ["--port-file", str(folder / f"worker-{index}.port")]
        ports += ["--http-port-file", str(folder / f"worker-{index}.http-port")]
        command = [sys.executable, "-m", "pipeline", *argv, *metrics, *ports]
        children.append(subprocess.Popen(command, env=env))
    return children


def _start_front(front: FrontProcess, settings: ProcessSettings, port: int, folder: Path) -> int:
    """Start the compiled front on the router's public address, before the workers' doors and their shared
    gRPC port on loopback (`port`); returns the port it serves."""
    workers = settings.group(RouterOptions).workers
    doors = [int((folder / f"worker-{i}.door").read_text()) for i in range(workers)]
    front.launch(settings, port, doors)
    return front.wait_listening()


def _write_ports(settings: ProcessSettings, http_port: int | None, port: int) -> None:
    """The router's port files, once every worker listens: the HTTP port first, as one router process writes
    them (whoever waits for the gRPC port's file then finds the HTTP one)."""
    if http_port is not None:
        write_port(settings.group(Http).http_port_file, http_port)
    write_port(settings.group(Listening).port_file, port)


def _where(settings: ProcessSettings) -> tuple[Listening, int | None, int]:
    """Where the router listens, its HTTP port and how many workers it runs."""
    return settings.group(Listening), settings.group(Http).http_port, settings.group(RouterOptions).workers


def run_workers(settings: ProcessSettings, argv: Sequence[str], front: FrontProcess | None = None) -> int:
    """Run `--workers` router processes on one port; `argv` is the router command line they repeat
    (each with its own port overrides appended, which argparse lets win). With a compiled `front`, the front
    serves the gRPC port and spreads the requests over the workers one by one, their own gRPC port shared
    on loopback behind it. Returns when they have stopped: on SIGTERM/SIGINT (forwarded to each, and to
    the front), or when one fails (the others are stopped)."""
    folder = Path(tempfile.mkdtemp(prefix="pipeline-router-"))  # mode 0700: the workers' sockets are private
    listening, http_port, workers = _where(settings)
    reserved = [_reserve(listening.host, listening.port) if front is None else _reserve(LOOPBACK, 0)]
    port = reserved[0].getsockname()[1]
    overrides = ["--workers", "1", "--port", str(port)]
    if http_port is not None:
        reserved.append(_reserve(listening.host, http_port))
        overrides += ["--http-port", str(reserved[-1].getsockname()[1])]
    metrics_server = _serve_metrics(listening, workers, folder)
    children = _start_workers(workers, folder, [*argv, *overrides], front)
    log.info("router: %d workers on %s:%d (SO_REUSEPORT)", workers, listening.host, port)

    stopping = False

    def forward(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in (*children, *(() if front is None or front.process is None else (front.process,))):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        if _wait_listening(folder, children, http=http_port is not None, doors=front is not None):
            if front is not None:
                port = _start_front(front, settings, port, folder)
            _write_ports(settings, None if http_port is None else reserved[1].getsockname()[1], port)
        pending = list(children)
        while pending:
            pid, status = os.wait()
            finished = next((c for c in pending if c.pid == pid), None)
            if finished is None:
                continue
            pending.remove(finished)
            finished.returncode = os.waitstatus_to_exitcode(status)
            if not stopping:
                log.error(
                    "router worker %d exited (%d): stopping the others",
                    children.index(finished),
                    finished.returncode,
                )
                code = finished.returncode or 1
                forward(signal.SIGTERM, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        for sock in reserved:
            sock.close()
        shutil.rmtree(folder, ignore_errors=True)
    return code

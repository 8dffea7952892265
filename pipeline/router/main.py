"""The router process: its flags, what they say to serve, and the server around `RouterPlane`.

`serve_router` listens (gRPC, and HTTP/REST beside it), waits for the stages and checks the plans, then
reports SERVING; `run_router` is the `pipeline router` command, one process or `--workers` of them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop
from grpc_health.v1 import health, health_pb2

from pipeline.ensemble.catalog import load_catalog, sources_digest
from pipeline.ensemble.plan import Catalog
from pipeline.ensemble.selection import selected
from pipeline.protocol.errors import ConfigError
from pipeline.router.front import FrontProcess, compiled, front_of, new_secret
from pipeline.router.frontdoor.codec_pool import CodecPool
from pipeline.router.frontdoor.http import RestFrontDoor, RestServer
from pipeline.router.frontdoor.torchserve_api import TorchServeApi
from pipeline.router.router_plane import RouterPlane
from pipeline.router.stages.targets import Resolve
from pipeline.router.workers import WorkerPeers, run_workers
from pipeline.runtime import router_settings
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.lifecycle import Door, ServerLifecycle
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.router_settings import Catalog as CatalogSettings
from pipeline.runtime.router_settings import (
    EnsembleLoading,
    Front,
    Http,
    Readiness,
    RouterOptions,
    StageTls,
    TorchServeStore,
)
from pipeline.runtime.security import (
    AccessPolicy,
    SecurityConfigError,
    access_policy_of,
    client_tls,
    interceptors_of,
    server_credentials_of,
    stage_token_of,
)
from pipeline.runtime.server import (
    INFERENCE_SERVICE,
    prepare_process,
)
from pipeline.runtime.server_settings import (
    Limits,
    Listening,
    Logging,
    ModelControl,
    RouterToken,
    Security,
    Shutdown,
)
from pipeline.runtime.settings_cli import ProcessSettings, add_arguments
from pipeline.runtime.shutdown import ABANDON_S
from pipeline.runtime.telemetry import Telemetry
from pipeline.transport import frame_server_of

log = logging.getLogger(__name__)


def router_sources(catalog: CatalogSettings) -> tuple[list[Path], Path | None]:
    """The YAML ensemble files and folders (`--ensembles`, default `ensembles/`) and the model repository
    the router's settings name."""
    # The ensembles folder is optional: a missing or empty one adds no ensemble.
    return list(catalog.ensembles), catalog.model_dir


def router_catalog(settings: ProcessSettings, *, exit_on_error: bool | None = None) -> Catalog:
    """What the router's flags say to serve: the ensembles of the model repository and of the YAML files
    (`--ensembles`, default `ensembles/` where it holds any), and the stages. Without `--stage`, a router
    given a repository calls the three stages at their `<STAGE>_ADDRESS`. An ensemble that fails to load
    raises `ConfigError` with `exit_on_error` (default: `--exit-on-error`), else the catalog lists it as
    failed. With `--load-model`, only the ensembles it selects are served (`pipeline.ensemble.selection`)."""
    sources = settings.group(CatalogSettings)
    ensembles, model_dir = router_sources(sources)
    if model_dir is not None and not model_dir.is_dir():
        raise ConfigError(f"--model-dir {model_dir}: no such folder")
    stages: dict[str, str] = {}
    for key, address in sources.stage or ():
        if key in stages:
            raise ConfigError(f"--stage {key}: given twice ({stages[key]} and {address})")
        stages[key] = address
    if not stages and model_dir is not None:
        stages = sources.stage_addresses()
    if exit_on_error is None:
        exit_on_error = settings.group(Readiness).exit_on_error
    catalog = load_catalog(ensembles, repository=model_dir, stages=stages, exit_on_error=False)
    catalog = selected(catalog, settings.group(EnsembleLoading).load_model)
    if catalog.failed and exit_on_error:
        raise ConfigError("\n".join(catalog.failed.values()))
    return catalog


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's flags (`pipeline.runtime.router_settings.RouterSettings`)."""
    add_arguments(parser, router_settings.RouterSettings)


def router_plane(
    settings: ProcessSettings,
    catalog: Catalog,
    *,
    telemetry: Telemetry,
    metrics: Metrics,
    resolve: Resolve | None = None,
    admin_configured: bool = False,
) -> RouterPlane:
    """The router's data plane as its settings say (`resolve` looks the stages' DNS names up;
    `admin_configured`: its access policy has an admin credential, which allows repository changes)."""
    options, readiness, tls = (
        settings.group(RouterOptions),
        settings.group(Readiness),
        settings.group(StageTls),
    )
    return RouterPlane(
        catalog,
        max_message_bytes=settings.group(Limits).max_message_bytes,
        telemetry=telemetry,
        metrics=metrics,
        stage_tls=client_tls(tls.stage_tls_ca, tls.stage_tls_cert, tls.stage_tls_key),
        stage_token=stage_token_of(settings.group(RouterToken)),
        max_inflight_requests=options.max_inflight_requests,
        max_batch_items=options.max_batch_items,
        cache_size=options.cache_size,
        resolve_interval=options.resolve_interval,
        resolve=resolve,
        strict_readiness=readiness.strict_readiness,
        exit_on_error=readiness.exit_on_error,
        model_control=settings.group(ModelControl).explicit,
        admin_configured=admin_configured,
    )


def _readiness(health_servicer: health.aio.HealthServicer) -> Callable[[bool], Awaitable[None]]:
    """What reports the router's readiness on its health service."""

    async def readiness(ready: bool) -> None:
        # "" is liveness: SERVING from the end of start-up until shutdown, whatever the stages do, so
        # that no probe restarts a router that only waits for a stage. The inference service is readiness:
        # SERVING exactly while ServerReady is true (strict: every ensemble available, every stage healthy).
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await health_servicer.set(INFERENCE_SERVICE, status)

    return readiness


def _front_door(handler: InferenceHandler, settings: ProcessSettings) -> RestFrontDoor:
    """The HTTP/REST endpoints over the router's handler, with its limits."""
    http = settings.group(Http)
    return RestFrontDoor(
        handler,
        max_body_bytes=settings.group(Limits).max_message_bytes,
        max_json_output_bytes=http.max_json_output_mb << 20,
        codec=CodecPool(http.http_codec_processes),
        torchserve=TorchServeApi(
            handler, settings.group(CatalogSettings).model_dir, settings.group(TorchServeStore).model_store
        ),
    )


async def _poll_ensembles(settings: ProcessSettings, plane: RouterPlane, interval: float) -> None:
    """Look at the ensemble files every `interval` seconds; when one was written, added or removed, load them
    all again and serve what changed (`RouterPlane.reload`)."""
    ensembles, model_dir = router_sources(settings.group(CatalogSettings))
    seen = await asyncio.to_thread(sources_digest, ensembles, repository=model_dir)
    while True:
        await asyncio.sleep(interval)
        digest = await asyncio.to_thread(sources_digest, ensembles, repository=model_dir)
        if digest == seen:
            continue
        seen = digest
        log.info("the ensemble files changed: loading them again")
        try:
            catalog = await asyncio.to_thread(router_catalog, settings, exit_on_error=False)
        except ConfigError as err:  # nothing to serve at all: keep serving what was loaded
            log.error("the ensemble files, read again, fail; the last good plans serve: %s", err)
            continue
        await plane.reload(catalog)


def _log_serving(plane: RouterPlane, address: str) -> None:
    """Say what the router serves once started, and which ensembles are not available (each was logged
    with its reason)."""
    unavailable = {**plane.ensembles.unavailable, **plane.ensembles.failed}
    served = [name for name in plane.ensembles.plans if name not in unavailable]
    missing = f"; not available: {', '.join(sorted(unavailable))} (see above)" if unavailable else ""
    log.info("router serving ensembles %s on %s%s", ", ".join(served) or "(none)", address, missing)


class _RouterServer(ServerLifecycle):
    """One router's life around its plane: its handler under every door (gRPC, HTTP/REST, frames, the
    compiled front) and what it does once they are open (find its stages, report readiness) and at its
    stop."""

    def __init__(
        self,
        settings: ProcessSettings,
        plane: RouterPlane,
        policy: AccessPolicy,
        metrics: Metrics,
        *,
        reuse_port: bool = False,
        http_bound: Callable[[int], None] | None = None,
    ) -> None:
        self.settings, self.plane = settings, plane
        #: A worker of `--workers N` shares its ports with the others.
        self.reuse_port = reuse_port
        limits, listening = settings.group(Limits), settings.group(Listening)
        handler = InferenceHandler(
            plane, "pipeline-router", limits, policy=policy, telemetry=plane.telemetry, metrics=metrics
        )
        # HTTP drains on gRPC's clock: its requests still held at the end of the grace period are answered
        # 503 (`pipeline.runtime.shutdown`), and have `ABANDON_S` for it.
        grace = settings.group(Shutdown).grace_period + ABANDON_S
        rest = RestServer(
            _front_door(handler, settings), settings, grace=grace, bound=http_bound, reuse_port=reuse_port
        )
        doors: list[Door] = [rest]
        # The stages' models send their calls (BLS) to the frame port; every other call is gRPC's.
        frames = frame_server_of(handler, listening, limits, settings.group(Security), reuse_port=reuse_port)
        if frames is not None:
            doors.append(frames)
        #: The compiled front that serves the gRPC port, where `--front` asks for it.
        self.front = front_of(settings, handler)
        if self.front is not None:
            doors.append(self.front)
        super().__init__(handler, settings, doors)
        self.tasks: list[asyncio.Task[None]] = []

    async def listen_router(self) -> None:
        """The router's gRPC server, listening where its settings say, with their TLS and access policy;
        behind a `front`, on loopback in plaintext, answering the front's calls alone (it serves the public
        port, with the TLS)."""
        listening, front = self.listening, self.front
        await self.listen(
            f"{listening.host}:{listening.port}" if front is None else front.router_address,
            credentials=server_credentials_of(self.settings.group(Security)) if front is None else None,
            interceptors=interceptors_of(self.handler.policy, None if front is None else front.secret),
            reuse_port=self.reuse_port,
        )

    async def ready(self, port: int) -> None:
        """Wait for the stages, then report live and ready."""
        settings, listening, plane = self.settings, self.listening, self.plane
        stages = ", ".join(plane.stages.clients)
        log.info("router listening on %s:%d; waiting for stages %s", listening.host, port, stages)
        await plane.discover()
        # Live now; ready as strict readiness says (never SERVING for a moment on the way to NOT_SERVING).
        readiness = _readiness(self.health)
        await readiness(plane.ready())
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.tasks.append(asyncio.create_task(plane.monitor(on_ready=readiness)))
        interval = settings.group(RouterOptions).repository_poll_secs
        if interval > 0:
            self.tasks.append(asyncio.create_task(_poll_ensembles(settings, plane, interval)))
        _log_serving(plane, f"{listening.host}:{port}")

    async def close(self) -> None:
        """Stop what `ready` started, the worker peers and the plane."""
        for task in self.tasks:
            task.cancel()
        if self.plane.model_statistics.peers is not None:
            await self.plane.model_statistics.peers.stop()
        await self.plane.close()


async def serve_router(
    settings: ProcessSettings,
    *,
    catalog: Catalog | None = None,
    stopping: asyncio.Event | None = None,
    bound: Callable[[int], None] | None = None,
    telemetry: Telemetry | None = None,
    metrics: Metrics | None = None,
    http_bound: Callable[[int], None] | None = None,
    resolve: Resolve | None = None,
) -> None:
    """Serve the ensembles until a signal (or `stopping`): listen, wait for the stages and check the plans,
    then SERVING. `bound` is called with the port once the server listens (`http_bound` with the HTTP
    port, first). `telemetry` defaults to tracing configured by the environment, `metrics` to a registry
    of this server's own."""
    if catalog is None:
        catalog = router_catalog(settings)
    owned = telemetry is None
    telemetry = Telemetry.from_env("router") if telemetry is None else telemetry
    metrics = Metrics() if metrics is None else metrics
    policy = access_policy_of(settings.group(Security))
    plane = router_plane(
        settings,
        catalog,
        telemetry=telemetry,
        metrics=metrics,
        resolve=resolve,
        admin_configured=policy.admin_configured,
    )
    peers = plane.model_statistics.peers = WorkerPeers.from_env()
    # A worker of `--workers N` shares its ports with the others.
    router = _RouterServer(
        settings, plane, policy, metrics, reuse_port=peers is not None, http_bound=http_bound
    )
    await router.listen_router()
    if peers is not None:
        await peers.start(plane.model_statistics.local, plane.model_statistics.local_cache_hits)
    await router.run(stopping=stopping, bound=bound, telemetry=telemetry if owned else None)


def run_router(settings: ProcessSettings) -> int:
    """Entry point of the router process, with the settings `pipeline router` read its command line into (a
    worker of `--workers N` runs the same command line)."""
    prepare_process(settings.group(Logging).level, "router")
    try:
        if settings.group(RouterOptions).workers > 1:
            path = compiled(settings.group(Front).front)
            front = None if path is None else FrontProcess(path, new_secret())
            return run_workers(settings, sys.argv[1:], front)
        uvloop.run(serve_router(settings))
    except (ConfigError, SecurityConfigError) as err:
        log.error("%s", err)
        return 2
    return 0

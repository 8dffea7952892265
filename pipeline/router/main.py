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

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2

from pipeline.ensemble.catalog import load_catalog, sources_digest
from pipeline.ensemble.plan import Catalog
from pipeline.protocol.errors import ConfigError
from pipeline.router.codec_pool import CodecPool
from pipeline.router.http import RestFrontDoor, RestServer, add_http_arguments
from pipeline.router.router_plane import RouterPlane
from pipeline.router.targets import Resolve
from pipeline.router.workers import WorkerPeers, run_workers
from pipeline.runtime import settings
from pipeline.runtime.arguments import add_server_arguments, inflight_bytes_of, positive_int
from pipeline.runtime.frame_server import frame_server_of
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.model_control import add_model_control_mode_argument, explicit_mode
from pipeline.runtime.security import (
    AccessPolicy,
    SecurityConfigError,
    access_policy_of,
    add_client_tls_arguments,
    client_tls,
    interceptors_of,
    server_credentials_of,
    stage_token_of,
)
from pipeline.runtime.server import (
    INFERENCE_SERVICE,
    create_server,
    prepare_process,
    serve,
    set_serving,
    start_metrics,
    write_port,
)
from pipeline.runtime.servicer import InferenceServicer
from pipeline.runtime.telemetry import Telemetry

log = logging.getLogger(__name__)


def stage_argument(value: str) -> tuple[str, str]:
    """An argparse type: `NAME=ADDRESS`."""
    name, sep, address = value.partition("=")
    if not sep or not name.strip() or not address.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=ADDRESS (e.g. model=127.0.0.1:8102), got {value!r}")
    return name.strip(), address.strip()


def router_sources(args: argparse.Namespace) -> tuple[list[Path], Path | None]:
    """The YAML ensemble files and folders (`--ensembles`, default `ensembles/`) and the model repository
    the router's flags name."""
    model_dir: Path | None = getattr(args, "model_dir", None)
    # The ensembles folder is optional: a missing or empty one adds no ensemble.
    ensembles = args.ensembles if args.ensembles is not None else [Path(settings.ENSEMBLES.get())]
    return list(ensembles), model_dir


def router_catalog(args: argparse.Namespace, *, exit_on_error: bool | None = None) -> Catalog:
    """What the router's flags say to serve: the ensembles of the model repository and of the YAML files
    (`--ensembles`, default `ensembles/` where it holds any), and the stages. Without `--stage`, a router
    given a repository calls the three stages at their `<STAGE>_ADDRESS`. An ensemble that fails to load
    raises `ConfigError` with `exit_on_error` (default: `--exit-on-error`), else the catalog lists it as
    failed."""
    ensembles, model_dir = router_sources(args)
    if model_dir is not None and not model_dir.is_dir():
        raise ConfigError(f"--model-dir {model_dir}: no such folder")
    stages: dict[str, str] = {}
    for key, address in getattr(args, "stage", None) or ():
        if key in stages:
            raise ConfigError(f"--stage {key}: given twice ({stages[key]} and {address})")
        stages[key] = address
    if not stages and model_dir is not None:
        stages = {stage: settings.stage_address(stage).get() for stage in settings.STAGES}
    if exit_on_error is None:
        exit_on_error = getattr(args, "exit_on_error", True)
    return load_catalog(ensembles, repository=model_dir, stages=stages, exit_on_error=exit_on_error)


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, service="router")
    parser.add_argument(
        "--ensembles",
        type=Path,
        nargs="+",
        default=None,
        help="ensemble YAML files or folders of them, beside the model repository's ensembles; a missing or "
        "empty folder adds none (env PIPELINE_ENSEMBLES; default: ensembles)",
    )
    parser.add_argument(
        "--model-dir",
        "--model-repository",
        type=Path,
        default=settings.Setting(settings.MODEL_DIR.variable, None, Path).get(),
        help="the Triton model repository the stages serve: its ensembles are served, config.pbtxt ones "
        '(platform "ensemble") and YAML ones (<ensemble>/ensemble.yaml) (env PIPELINE_MODEL_DIR)',
    )
    parser.add_argument(
        "--stage",
        type=stage_argument,
        action="append",
        metavar="NAME=ADDRESS",
        help="a stage service the router calls (repeatable): it serves the steps that name it, and the steps "
        "that name no stage whose model its RepositoryIndex lists; every model of its repository is served "
        "here too. Default with --model-dir: "
        + ", ".join(
            f"{stage}=${settings.stage_address(stage).variable} (else {settings.stage_address(stage).default})"
            for stage in settings.STAGES
        ),
    )
    parser.add_argument(
        "--max-inflight-requests",
        type=int,
        default=settings.MAX_INFLIGHT_REQUESTS.get(),
        help="inference requests held at once; more are refused with UNAVAILABLE, so memory stays bounded "
        "under overload; 0 for no limit (env PIPELINE_MAX_INFLIGHT_REQUESTS; default %(default)s)",
    )
    parser.add_argument(
        "--cache-size",
        type=settings.byte_count,
        default=settings.CACHE_SIZE.get(),
        help="bytes of the response cache (suffixes k, M, G: powers of 1024), for the stage models and ensembles "
        "whose config enables response_cache; Triton's --cache-config local,size=N; 0 turns it off "
        "(env PIPELINE_CACHE_SIZE; default %(default)s)",
    )
    parser.add_argument(
        "--max-batch-items",
        type=positive_int,
        default=settings.MAX_BATCH_ITEMS.get(),
        help="items (dimension 0) one request may carry, whatever the model allows "
        "(env PIPELINE_MAX_BATCH_ITEMS; default %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=settings.ROUTER_WORKERS.get(),
        help="router processes serving the same ports (SO_REUSEPORT: the kernel spreads connections over "
        "them); each batches its own share, and metrics and statistics cover them all "
        "(env PIPELINE_ROUTER_WORKERS; default %(default)s)",
    )
    parser.add_argument(
        "--resolve-interval",
        type=float,
        default=settings.RESOLVE_INTERVAL_S.get(),
        help="seconds between look-ups of the stages' DNS names: a new replica gets calls, and one that is "
        "gone stops getting them, within about this long (env PIPELINE_RESOLVE_INTERVAL_S; default "
        "%(default)s)",
    )
    parser.add_argument(
        "--strict-readiness",
        type=settings.flag,
        default=settings.STRICT_READINESS.get(),
        metavar="BOOL",
        help="true: ready (ServerReady, the health of inference.GRPCInferenceService, /v2/health/ready) only "
        "while every ensemble is available and every stage healthy, as Triton's default; false: ready once "
        "started, each model's readiness its own (env PIPELINE_STRICT_READINESS; default %(default)s)",
    )
    parser.add_argument(
        "--exit-on-error",
        type=settings.flag,
        default=settings.EXIT_ON_ERROR.get(),
        metavar="BOOL",
        help="true: an ensemble that fails to load or to check against its models stops the router at "
        "start-up, as Triton's default; false: the router serves the others, and lists the failed one as "
        "UNAVAILABLE with the reason (RepositoryIndex; ModelReady false; requests get UNAVAILABLE) "
        "(env PIPELINE_EXIT_ON_ERROR; default %(default)s)",
    )
    parser.add_argument(
        "--repository-poll-secs",
        type=float,
        default=settings.REPOSITORY_POLL_SECS.get(),
        help="seconds between looks at the ensemble files (--ensembles, and the model repository's "
        "ensembles) for changes, as Triton's poll mode: a changed, added or removed file is loaded, and one "
        "that fails keeps its last good plan; 0 never looks (env PIPELINE_REPOSITORY_POLL_SECS; default "
        "%(default)s)",
    )
    add_model_control_mode_argument(parser)
    add_http_arguments(parser)
    add_client_tls_arguments(parser, prefix="stage-", env_prefix="PIPELINE_STAGE_")


def router_plane(
    args: argparse.Namespace,
    catalog: Catalog,
    *,
    telemetry: Telemetry,
    metrics: Metrics,
    resolve: Resolve | None = None,
    admin_configured: bool = False,
) -> RouterPlane:
    """The router's data plane as its flags say (`resolve` looks the stages' DNS names up;
    `admin_configured`: its access policy has an admin credential, which allows repository changes)."""
    return RouterPlane(
        catalog,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        telemetry=telemetry,
        metrics=metrics,
        stage_tls=client_tls(
            getattr(args, "stage_tls_ca", None),
            getattr(args, "stage_tls_cert", None),
            getattr(args, "stage_tls_key", None),
        ),
        stage_token=stage_token_of(args),
        max_inflight_requests=getattr(args, "max_inflight_requests", 0),
        max_batch_items=getattr(args, "max_batch_items", 0),
        cache_size=getattr(args, "cache_size", 0),
        resolve_interval=getattr(args, "resolve_interval", None),
        resolve=resolve,
        strict_readiness=getattr(args, "strict_readiness", True),
        exit_on_error=getattr(args, "exit_on_error", True),
        model_control=explicit_mode(args),
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


def _front_door(servicer: InferenceServicer, args: argparse.Namespace, policy: AccessPolicy) -> RestFrontDoor:
    """The HTTP/REST endpoints over the gRPC servicer, with its tokens and limits."""
    return RestFrontDoor(
        servicer,
        policy=policy,
        max_body_bytes=args.max_message_mb * 1024 * 1024,
        max_json_output_bytes=getattr(args, "max_json_output_mb", settings.MAX_JSON_OUTPUT_MB.default) << 20,
        codec=CodecPool(getattr(args, "http_codec_processes", settings.HTTP_CODEC_PROCESSES.default)),
    )


async def _listen(
    args: argparse.Namespace,
    servicer: InferenceServicer,
    health_servicer: health.aio.HealthServicer,
    policy: AccessPolicy,
) -> tuple[grpc.aio.Server, int]:
    """The router's gRPC server, listening where its flags say, with their TLS and access policy."""
    return await create_server(
        f"{args.host}:{args.port}",
        servicer,
        health_servicer,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        credentials=server_credentials_of(args),
        interceptors=interceptors_of(policy),
        reuse_port=args.reuse_port,
    )


async def _poll_ensembles(args: argparse.Namespace, plane: RouterPlane, interval: float) -> None:
    """Look at the ensemble files every `interval` seconds; when one was written, added or removed, load them
    all again and serve what changed (`RouterPlane.reload`)."""
    ensembles, model_dir = router_sources(args)
    seen = await asyncio.to_thread(sources_digest, ensembles, repository=model_dir)
    while True:
        await asyncio.sleep(interval)
        digest = await asyncio.to_thread(sources_digest, ensembles, repository=model_dir)
        if digest == seen:
            continue
        seen = digest
        log.info("the ensemble files changed: loading them again")
        try:
            catalog = await asyncio.to_thread(router_catalog, args, exit_on_error=False)
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


async def serve_router(
    args: argparse.Namespace,
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
        catalog = router_catalog(args)
    owned = telemetry is None
    telemetry = Telemetry.from_env("router") if telemetry is None else telemetry
    metrics = Metrics() if metrics is None else metrics
    policy = access_policy_of(args)
    plane = router_plane(
        args,
        catalog,
        telemetry=telemetry,
        metrics=metrics,
        resolve=resolve,
        admin_configured=policy.admin_configured,
    )
    plane.peers = peers = WorkerPeers.from_env()
    # A worker of `--workers N` shares its ports with the others.
    args.reuse_port = peers is not None
    health_servicer = health.aio.HealthServicer()
    await set_serving(health_servicer, False)
    budget = inflight_bytes_of(args)
    servicer = InferenceServicer(
        plane, "pipeline-router", telemetry=telemetry, metrics=metrics, max_inflight_bytes=budget
    )
    rest = RestServer(_front_door(servicer, args, policy), grace=args.grace_period)
    # The stages' models send their calls (BLS) here; every other call is gRPC's.
    frames = frame_server_of(servicer, args, policy)
    server, port = await _listen(args, servicer, health_servicer, policy)
    monitor: asyncio.Task[None] | None = None
    poll: asyncio.Task[None] | None = None

    async def start() -> None:
        nonlocal monitor, poll
        if peers is not None:
            await peers.start(plane.local_statistics)
        start_metrics(metrics, args)
        await rest.start(args, http_bound)
        if frames is not None:
            servicer.frames_port = await frames.start(args.host, args.frames_port, reuse_port=args.reuse_port)
        write_port(args.port_file, port)
        if bound is not None:
            bound(port)
        stages = ", ".join(plane.stages.clients)
        log.info("router listening on %s:%d; waiting for stages %s", args.host, port, stages)
        await plane.discover()
        # Live now; ready as strict readiness says (never SERVING for a moment on the way to NOT_SERVING).
        readiness = _readiness(health_servicer)
        await readiness(plane.ready())
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        monitor = asyncio.create_task(plane.monitor(on_ready=readiness))
        interval = getattr(args, "repository_poll_secs", 0.0)
        if interval > 0:
            poll = asyncio.create_task(_poll_ensembles(args, plane, interval))
        _log_serving(plane, f"{args.host}:{port}")

    async def stop() -> None:
        for task in (monitor, poll):
            if task is not None:
                task.cancel()
        await rest.stop()
        if peers is not None:
            await peers.stop()
        await plane.close()
        metrics.close()
        if owned:
            # Flushing may wait on an exporter's endpoint: not on the event loop.
            await asyncio.to_thread(telemetry.shutdown)

    await serve(
        server,
        health_servicer,
        grace=args.grace_period,
        start=start,
        stop=stop,
        stopping=stopping,
        drain_delay=getattr(args, "drain_delay", 0.0),
        drain=None if frames is None else frames.close,
    )


def run_router(args: argparse.Namespace) -> int:
    """Entry point of the router process."""
    prepare_process(args.log_level, "router")
    if args.workers > 1:
        return run_workers(args, sys.argv[1:])
    try:
        uvloop.run(serve_router(args))
    except (ConfigError, SecurityConfigError) as err:
        log.error("%s", err)
        return 2
    return 0

"""`pipeline run`: the whole pipeline on this machine as processes, no containers.

Starts the three stage services and the router on one model repository (`--model-dir`), waits until each is
healthy, then supervises them (`pipeline.tools.supervisor`): a process that dies is started again on its
ports while the others serve, and one that keeps dying stops the pipeline, named with its last lines of
output. A process that dies before the pipeline first serves stops it at once (a configuration error, not a
crash). Ctrl-C or SIGTERM stops the router first (it drains in-flight requests while the stages still
serve), then the stages, all at once; each gets its drain delay, grace period and a margin before it is
SIGKILLed. The services end with the launcher even when it is killed (`pipeline.runtime.shutdown`).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pipeline.ensemble.catalog import load_sources
from pipeline.ensemble.plan import EnsemblePlan
from pipeline.ensemble.selection import named, selection
from pipeline.protocol.errors import ConfigError
from pipeline.runtime import server_settings
from pipeline.runtime.router_settings import Front, Readiness, RouterOptions
from pipeline.runtime.security import channel_credentials
from pipeline.runtime.server_settings import Logging, ModelControl, RouterToken, Security
from pipeline.runtime.settings_cli import ProcessSettings, from_environment, variable_of, variable_text
from pipeline.tools.autoscaler import (
    RESOLVE_INTERVAL_S,
    Autoscaling,
    LocalAutoscaler,
    scaled_stage,
    write_addresses,
)
from pipeline.tools.launcher_settings import (
    Launcher,
    LauncherLoading,
    LauncherPorts,
    LauncherSecurity,
    LauncherStagePorts,
    Restarts,
)
from pipeline.tools.model_selection import load_model_flags, stage_models, unknown_names
from pipeline.tools.model_store import LauncherModelStore, model_store_repository
from pipeline.tools.supervisor import (
    RestartPolicy,
    Service,
    Supervisor,
    stop,
    stop_within,
    wait_healthy,
)

log = logging.getLogger("pipeline.launcher")

#: The stage services, each run as `python -m services.<stage>`.
STAGES = ("preprocess", "model", "postprocess")
#: The files `--tls-dir` holds (`scripts/make-certs.sh` writes them).
TLS_FILES = ("ca.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")


class _Stop(Exception):
    """SIGTERM or SIGINT asked the launcher to stop."""


#: The variables that turn authentication on in every service (`pipeline.runtime.security`).
AUTH_VARIABLES = tuple(
    variable_of(Security, name)
    for name in ("auth_tokens", "auth_tokens_file", "admin_tokens", "admin_tokens_file")
)
#: The router's stage token, and the file that may hold it instead.
STAGE_TOKEN, STAGE_TOKEN_FILE = (
    variable_of(RouterToken, "stage_token"),
    variable_of(RouterToken, "stage_token_file"),
)
ADMIN_TOKENS, ADMIN_TOKENS_FILE = (
    variable_of(Security, "admin_tokens"),
    variable_of(Security, "admin_tokens_file"),
)


def stage_token_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The router's stage token for the services' environment: with tokens configured, every stage asks the
    router for one too, so the launcher makes one (unless `PIPELINE_STAGE_TOKEN` or `..._FILE` gives it).
    It travels in the environment, which other users cannot read, not on the command line."""
    if not any(variable_text(variable, environ) for variable in AUTH_VARIABLES):
        return {}
    if variable_text(STAGE_TOKEN, environ) or variable_text(STAGE_TOKEN_FILE, environ):
        return {}
    return {STAGE_TOKEN: secrets.token_urlsafe(32)}


def stage_admin_env(environ: Mapping[str, str], token_env: Mapping[str, str]) -> dict[str, str]:
    """With admin tokens configured, the stages take the router's stage token (`token_env`'s, else the
    environment's) as an admin token too: the router loads what the fleet serves on every replica, one that
    starts later (a restart, a scale-up) included, with its own token."""
    if not (variable_text(ADMIN_TOKENS, environ) or variable_text(ADMIN_TOKENS_FILE, environ)):
        return {}
    token = token_env.get(STAGE_TOKEN) or variable_text(STAGE_TOKEN, environ)
    if not token:
        return {}
    listed = variable_text(ADMIN_TOKENS, environ)
    return {ADMIN_TOKENS: f"{listed},{token}" if listed else token}


def _ensembles(folder: Path, model_dir: Path, load_model: list[str]) -> list[str]:
    """The ensembles the router serves: the repository's and those of the YAML files of `folder` (one that
    does not load is named so; the router says why, and stops unless --exit-on-error is false), those
    `load_model` selects where it names any."""
    loaded = load_sources([folder], repository=model_dir)
    if (wanted := named(load_model)) is not None:
        chosen, _ = selection(wanted, {item.name: item for item in loaded if isinstance(item, EnsemblePlan)})
        loaded = [item for item in loaded if item.name in chosen or item.name in wanted]
    return sorted(
        item.name if isinstance(item, EnsemblePlan) else f"{item.name} (does not load)" for item in loaded
    )


def run(settings: ProcessSettings) -> int:
    """Start the pipeline as `pipeline run`'s settings (`pipeline.tools.launcher_settings.LauncherSettings`)
    say, and supervise it until a signal, or until a process keeps dying; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s: %(message)s")
    try:
        refused = _refusal(settings)
        store_repository = None if refused else model_store_repository(settings.group(LauncherModelStore))
    except ConfigError as err:
        refused = str(err)
    if refused:
        log.error("%s", refused)
        return 2
    if store_repository is not None:
        # The store's archives, as a model repository (this run's).
        settings = settings.model_copy(update={"model_dir": store_repository})
    security, launcher = settings.group(LauncherSecurity), settings.group(Launcher)
    tls = _tls(security.tls_dir, security.mtls) if security.tls_dir is not None else _Tls()
    grace = ["--grace-period", str(launcher.grace_period)]
    # One repository for every service: each serves the entries whose backend it runs.
    ports = Path(tempfile.mkdtemp(prefix="pipeline-ports-"))
    # The models' calls to other models (BLS) go to the router, whose port the stages read where it writes it.
    router_port = ["--router-port-file", str(ports / "router")]
    stage_flags = _stage_flags(settings, [*grace, *tls.stage, *router_port])
    stages = _stage_services(settings, stage_flags)
    http_port_file = ports / "router.http"
    router = _router_service(settings, grace, tls.router, http_port_file)
    everything = [router, *stages]  # stop order: the router drains while the stages still serve
    stage_env = _hand_tokens(router, stages)
    autoscale = settings.group(Autoscaling).autoscale
    host = settings.group(LauncherPorts).host
    signals = _StopOnSignal()
    supervisor: Supervisor | None = None
    autoscaler: LocalAutoscaler | None = None
    try:
        signals.install()
        _start(stages, router, host, ports, launcher.startup_timeout, tls.credentials, autoscale)
        _pin_ports(everything, ports, http_port_file)
        supervisor = _supervisor(settings, everything, ports, tls.credentials)
        if autoscale:
            autoscaler = _autoscaler(settings, stages, router, supervisor, stage_flags, stage_env)
        secure = security.tls_dir is not None
        _announce(settings, router, stages, ports, http_port_file, secure=secure, autoscaler=autoscaler)
        return supervisor.run(lambda: signals.stopping, tick=autoscaler.step if autoscaler else None)
    except _Stop:
        return 0
    except RuntimeError as err:
        log.error("%s; stopping the pipeline", err)
        return 1
    finally:
        log.info("stopping: router first, then the stages")
        if autoscaler is not None:
            autoscaler.close()
        _stop_all(router, supervisor.services if supervisor is not None else everything, launcher)
        shutil.rmtree(ports, ignore_errors=True)
        if store_repository is not None:
            shutil.rmtree(store_repository, ignore_errors=True)


def _supervisor(
    settings: ProcessSettings,
    services: list[Service],
    ports: Path,
    credentials: grpc.ChannelCredentials | None,
) -> Supervisor:
    """What restarts the services that die, as `--restart-limit` and `--restart-window` say."""
    restarts, host = settings.group(Restarts), settings.group(LauncherPorts).host
    return Supervisor(
        services,
        RestartPolicy(limit=restarts.restart_limit, window=restarts.restart_window),
        host=host,
        connect=_connect_address(host),
        ports=ports,
        startup_timeout=settings.group(Launcher).startup_timeout,
        credentials=credentials,
    )


def _hand_tokens(router: Service, stages: list[Service]) -> dict[str, str]:
    """The router's stage token in every service's environment (`stage_token_env`), and the stages'
    admin tokens (`stage_admin_env`); returns what the stages' environment gained, for their replicas."""
    stage_token = stage_token_env(os.environ)
    router.env.update(stage_token)
    stage_env = {**stage_token, **stage_admin_env(os.environ, stage_token)}
    for service in stages:
        service.env.update(stage_env)
    return stage_env


def _refusal(settings: ProcessSettings) -> str | None:
    """Why the settings cannot run the pipeline, if they cannot: missing TLS files, autoscaling that cannot
    work, `--load-model` names that are not there."""
    tls_dir, launcher = settings.group(LauncherSecurity).tls_dir, settings.group(Launcher)
    if tls_dir is not None and (missing := _missing_tls_files(tls_dir)):
        return f"--tls-dir: missing {', '.join(missing)} (make them with scripts/make-certs.sh)"
    autoscale = settings.group(Autoscaling).autoscale
    if autoscale and launcher.metrics_port is None:
        return "--autoscale reads the router's metrics: it needs --metrics-port (not 'off')"
    if unknown := sorted(set(autoscale) - set(STAGES)):
        return f"--autoscale: unknown stage(s) {', '.join(unknown)} (stages: {', '.join(STAGES)})"
    load_model = settings.group(LauncherLoading).load_model
    if unknown := unknown_names(load_model, launcher.model_dir, launcher.ensembles):
        return (
            f"--load-model: no model or ensemble named {', '.join(map(repr, unknown))} in the model "
            f"repository {launcher.model_dir} or the ensembles of {launcher.ensembles}"
        )
    return None


def _autoscaler(
    settings: ProcessSettings,
    stages: list[Service],
    router: Service,
    supervisor: Supervisor,
    flags: Mapping[str, list[str]],
    env: dict[str, str],
) -> LocalAutoscaler:
    """The autoscaler of `pipeline run --autoscale`, its stages' first replicas those started."""
    ports, autoscaling = supervisor.ports, settings.group(Autoscaling)
    scaled = [
        scaled_stage(
            kind,
            bounds,
            autoscaling,
            addresses_file(ports, kind),
            [s for s in stages if s.name.split("-")[0] == kind],
        )
        for kind, bounds in autoscaling.autoscale.items()
    ]

    def new_replica(kind: str, number: int) -> Service:
        service = _stage_service(kind, number, 0, flags)
        service.env.update(env)
        return service

    def metrics_url() -> str | None:
        port = router.metrics_port(ports / router.name)
        return None if port is None else f"http://{supervisor.connect}:{port}/metrics"

    return LocalAutoscaler(
        scaled,
        new_replica=new_replica,
        supervisor=supervisor,
        metrics_url=metrics_url,
        interval=autoscaling.autoscale_interval,
        stop_within=_stop_within(settings.group(Launcher)),
        metrics_port=autoscaling.autoscale_metrics_port,
        host=settings.group(LauncherPorts).host,
    )


def _stop_all(router: Service, services: list[Service], launcher: Launcher) -> None:
    """Stop the router first (it drains while the stages still serve), then every other service at once."""
    within = _stop_within(launcher)
    stop([router], within)
    stop([s for s in services if s is not router], within)


def _stop_within(launcher: Launcher) -> float:
    """How long a service gets to stop before it is killed: its drain delay (from the environment, as the
    services read it), the grace period and margins (`pipeline.tools.supervisor.stop_within`)."""
    given, delay = from_environment(server_settings.Shutdown, "drain_delay")
    return stop_within(launcher.grace_period, delay if given else server_settings.Shutdown().drain_delay)


def _pin_ports(services: list[Service], ports: Path, http_port_file: Path) -> None:
    """Keep the ports each service bound at its first start (the OS's picks for port 0) for its restarts,
    so that the router finds a restarted stage, and clients a restarted router, where they were."""
    for service in services:
        metrics = service.metrics_port(ports / service.name)
        if metrics is not None:
            service.pin("--metrics-port", str(metrics))
        if service.name == "router" and http_port_file.exists():
            service.pin("--http-port", http_port_file.read_text().strip())


@dataclass(frozen=True)
class _Tls:
    """The TLS flags of each kind of service, and the credentials of the launcher's own health checks."""

    #: A stage's: its own certificate, and the CA that signs the router's client certificate.
    stage: list[str] = field(default_factory=list)
    #: The router's: its own certificate, its clients' CA (with --mtls), and what it shows the stages.
    router: list[str] = field(default_factory=list)
    credentials: grpc.ChannelCredentials | None = None


def _missing_tls_files(tls_dir: Path) -> list[str]:
    return [str(tls_dir / name) for name in TLS_FILES if not (tls_dir / name).is_file()]


def _tls(tls_dir: Path, mtls: bool) -> _Tls:
    """TLS on every hop from the files of `tls_dir`: stages accept only the router's client certificate."""
    ca, client_cert, client_key = (str(tls_dir / n) for n in ("ca.pem", "client.pem", "client-key.pem"))
    served = ["--tls-cert", str(tls_dir / "server.pem"), "--tls-key", str(tls_dir / "server-key.pem")]
    router = [*served, *(["--tls-ca", ca] if mtls else [])]
    router += ["--stage-tls-ca", ca, "--stage-tls-cert", client_cert, "--stage-tls-key", client_key]
    # The launcher's own health checks present the client certificate wherever one is asked for.
    credentials = channel_credentials(ca, client_cert, client_key)
    return _Tls(stage=[*served, "--tls-ca", ca], router=router, credentials=credentials)


def _triton_flags(settings: ProcessSettings) -> list[str]:
    """The flags of Triton's that every service takes, as `pipeline run` was given them."""
    logging_ = settings.group(Logging)
    return [
        f"--model-control-mode={settings.group(ModelControl).model_control_mode}",
        f"--log-level={logging_.log_level}",
        f"--log-verbose={logging_.log_verbose}",
    ]


def _stage_flags(settings: ProcessSettings, shared: list[str]) -> dict[str, list[str]]:
    """Each kind of stage's flags: `shared`, the model repository, Triton's flags, and where `--load-model`
    selects the models, those of them it runs (`pipeline.tools.model_selection`)."""
    launcher = settings.group(Launcher)
    loads = stage_models(settings.group(LauncherLoading).load_model, launcher.model_dir, launcher.ensembles)
    flags = ["--model-dir", str(launcher.model_dir), *shared, *_triton_flags(settings)]
    return {kind: [*flags, *([] if loads is None else load_model_flags(loads[kind]))] for kind in STAGES}


def _stage_services(settings: ProcessSettings, flags: Mapping[str, list[str]]) -> list[Service]:
    """Every stage service, `--replicas` processes of each (at least an autoscaled stage's minimum), each with
    its kind's `flags`."""
    ports = settings.group(LauncherStagePorts).stage_ports()
    autoscale = settings.group(Autoscaling).autoscale
    replicas = settings.group(LauncherSecurity).replicas
    stages: list[Service] = []
    for kind in STAGES:
        count = replicas.get(kind, 1)
        if kind in autoscale:
            count = min(max(count, autoscale[kind][0]), autoscale[kind][1])
        numbered = count > 1 or kind in autoscale
        for i in range(count):
            port = ports[kind] if i == 0 else 0
            stages.append(_stage_service(kind, i + 1 if numbered else 0, port, flags))
    return stages


def _stage_service(kind: str, number: int, port: int, flags: Mapping[str, list[str]]) -> Service:
    """One stage process: `kind-number` (just `kind` for number 0), on `port` (0: one the OS picks), with its
    kind's `flags`."""
    # Further replicas take ports the OS picks: the default ports of the stages are adjacent.
    name = f"{kind}-{number}" if number else kind
    # Metrics: where the environment says for the first replica, else a port the OS picks, so that stages
    # (and further replicas) never collide.
    given, port_given = from_environment(server_settings.listening(kind), "metrics_port")
    wanted = port_given if number <= 1 and given else 0
    metrics = ["--metrics-port", "off" if wanted is None else str(wanted)]
    return Service(name, ["-m", f"services.{kind}"], port, [*flags[kind], *metrics])


def _router_service(
    settings: ProcessSettings, grace: list[str], tls: list[str], http_port_file: Path
) -> Service:
    """The router service; it writes the HTTP port it binds to `http_port_file`."""
    where, launcher, readiness = (
        settings.group(LauncherPorts),
        settings.group(Launcher),
        settings.group(Readiness),
    )
    router_metrics = [
        "--metrics-port",
        "off" if launcher.metrics_port is None else str(launcher.metrics_port),
    ]
    router_http = ["--http-port", "off" if where.http_port is None else str(where.http_port)]
    router_http += ["--http-port-file", str(http_port_file)]
    router = Service(
        "router",
        ["-m", "pipeline", "router"],
        where.port,
        ["--ensembles", str(launcher.ensembles), *grace, *router_metrics, *router_http, *tls],
    )
    router.args += ["--model-dir", str(launcher.model_dir)]  # its config.pbtxt ensembles, the stages' models
    workers = max(1, settings.group(LauncherSecurity).router_workers)
    router.args += ["--workers", str(workers), *_triton_flags(settings)]
    front = settings.group(Front)
    router.args += ["--front", front.front, "--front-merge-inflight", str(front.front_merge_inflight)]
    router.args += [f"--strict-readiness={str(readiness.strict_readiness).lower()}"]
    router.args += [f"--exit-on-error={str(readiness.exit_on_error).lower()}"]
    router.args += [
        f"--load-model={name}" for name in named(settings.group(LauncherLoading).load_model) or ()
    ]
    store = settings.group(LauncherModelStore).model_store
    if store is not None:
        router.args += ["--model-store", str(store)]  # TorchServe's register reads it
    return router


def addresses_file(ports: Path, kind: str) -> Path:
    """Where the router reads the replicas of an autoscaled stage."""
    return ports / f"{kind}.addresses"


def _connect_address(host: str) -> str:
    """Where the launcher reaches a service that binds `host` (a wildcard address is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host


def _start(
    stages: list[Service],
    router: Service,
    host: str,
    ports: Path,
    timeout: float,
    credentials: grpc.ChannelCredentials | None,
    autoscaled: Collection[str] = (),
) -> None:
    """Start the stages, then the router on their addresses, and wait until every one is healthy; each
    writes the port it binds to its file in `ports`. The router reads the replicas of the `autoscaled` stages
    from a file of addresses, which the autoscaler rewrites as it adds and removes them."""
    connect = _connect_address(host)
    for service in stages:
        service.start(host, ports / service.name)
    for service in stages:
        service.wait_port(ports / service.name, timeout)
    # The ensembles name their stages' addresses through these variables; several replicas of a stage
    # become one target that the router spreads calls over.
    for kind in STAGES:
        replicas = [s for s in stages if s.name.split("-")[0] == kind]
        ports_of = [f"{connect}:{s.port}" for s in replicas]
        address = ports_of[0] if len(ports_of) == 1 else "ipv4:" + ",".join(ports_of)
        if kind in autoscaled:
            write_addresses(addresses_file(ports, kind), replicas, connect)
            address = f"file:{addresses_file(ports, kind)}"
        router.env[f"{kind.upper()}_ADDRESS"] = address
    resolve_interval = variable_of(RouterOptions, "resolve_interval")
    if autoscaled and not variable_text(resolve_interval):
        router.env[resolve_interval] = str(RESOLVE_INTERVAL_S)
    router.start(host, ports / router.name)
    router.wait_port(ports / router.name, timeout)
    for service in [*stages, router]:
        log.info("waiting for %s to become healthy", service.name)
        wait_healthy(service, f"{connect}:{service.port}", timeout, credentials)


def _announce(
    settings: ProcessSettings,
    router: Service,
    stages: list[Service],
    ports: Path,
    http_port_file: Path,
    *,
    secure: bool,
    autoscaler: LocalAutoscaler | None = None,
) -> None:
    """Print what the pipeline serves and where, and where each process's Prometheus metrics are."""
    connect, launcher = _connect_address(settings.group(LauncherPorts).host), settings.group(Launcher)
    http = ""
    if http_port_file.exists():  # written before the router's gRPC port, so there by now
        scheme = "https" if secure else "http"
        http = f" and {scheme}://{connect}:{int(http_port_file.read_text())} (HTTP/REST)"
    load_model = settings.group(LauncherLoading).load_model
    ensembles = ", ".join(_ensembles(launcher.ensembles, launcher.model_dir, load_model)) or "no ensemble"
    print(
        f"pipeline: serving {ensembles} on "
        f"{connect}:{router.port} (gRPC{' over TLS' if secure else ''}){http}, Open Inference Protocol; "
        "stages: "
        + ", ".join(f"{s.name} {connect}:{s.port} (pid {s.pid})" for s in stages)
        + ". Ctrl-C stops it.",
        flush=True,
    )
    if autoscaler is not None:
        print(
            "pipeline: autoscaling "
            + ", ".join(
                f"{kind} {s.autoscaler.targets.minimum}..{s.autoscaler.targets.maximum}"
                for kind, s in autoscaler.stages.items()
            )
            + f"; its decisions: http://{connect}:{autoscaler.metrics_server_port}/metrics",
            flush=True,
        )
    scraped = [(s.name, s.metrics_port(ports / s.name)) for s in [router, *stages]]
    if any(port is not None for _, port in scraped):
        print(
            "pipeline: Prometheus metrics: "
            + ", ".join(
                f"{name} http://{connect}:{port}/metrics" for name, port in scraped if port is not None
            ),
            flush=True,
        )


class _StopOnSignal:
    """SIGTERM and SIGINT stop the launcher: the first raises `_Stop`, later ones are ignored."""

    def __init__(self) -> None:
        self.stopping = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.stopping:
            return  # already stopping: a second signal must not interrupt the orderly stop
        self.stopping = True
        # NOTE: raised in the main thread wherever it is (starting a process, waiting for a port or for
        # health), so a signal stops the launcher at once, not after the start-up timeout.
        raise _Stop

"""A stage service process: serve `Stage` objects and the repository models of its backends until a signal."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import uvloop

from pipeline.ensemble.catalog import ensemble_plans
from pipeline.ensemble.selection import EVERYTHING
from pipeline.protocol.errors import ConfigError
from pipeline.runtime import service_settings
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.lifecycle import ServerLifecycle
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.model_metrics import MODEL_FAMILIES, Snapshot, families_handler
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.security import (
    AccessPolicy,
    SecurityConfigError,
    access_policy_of,
    client_tls,
    interceptors_of,
    server_credentials_of,
)
from pipeline.runtime.server import (
    prepare_process,
    set_serving,
)
from pipeline.runtime.server_settings import (
    Instances,
    Limits,
    Listening,
    Logging,
    ModelControl,
    RouterLink,
    Security,
    StageToken,
)
from pipeline.runtime.service_settings import Loading, Repository, StageEnsembles
from pipeline.runtime.settings_cli import ProcessSettings, add_arguments
from pipeline.runtime.telemetry import Telemetry
from pipeline.stage.api import Stage
from pipeline.stage.control import model_control_of
from pipeline.stage.placement import python_models_of, unplaced_python_models
from pipeline.stage.python_backend import PythonBackend
from pipeline.stage.router_link import RouterClient
from pipeline.stage.stage_plane import StagePlane
from pipeline.transport import frame_server_of

if TYPE_CHECKING:
    from pipeline.stage.backend import Backend
log = logging.getLogger(__name__)


def repository_models(loading: Loading) -> list[str] | None:
    """The models `--load-model` (or its environment variable) names, or None for all of them (none given, or
    Triton's `*`); a blank name alone names none (`pipeline run` gives it to a stage that runs none of the
    models its `--load-model` selects)."""
    if not loading.load_model:
        return None
    names = [name.strip() for name in loading.load_model if name.strip()]
    return None if EVERYTHING in names else names


class _StageServer(ServerLifecycle):
    """A stage service's life around its plane: its handler under its doors (gRPC, frames) and what it does
    once they are open (load its models, report SERVING) and at its stop."""

    def __init__(
        self, plane: StagePlane, settings: ProcessSettings, service: str, policy: AccessPolicy
    ) -> None:
        self.plane, self.service = plane, service
        self.security = settings.group(Security)
        limits, listening = settings.group(Limits), settings.group(Listening)
        handler = InferenceHandler(
            plane, service, limits, policy=policy, telemetry=plane.telemetry, metrics=plane.metrics
        )
        frames = frame_server_of(handler, listening, limits, self.security)
        super().__init__(handler, settings, () if frames is None else (frames,))

    async def ready(self, port: int) -> None:
        """Load the models, then report SERVING."""
        listening, plane, service = self.listening, self.plane, self.service
        source = f" and the repository {plane.repository.root}" if plane.repository is not None else ""
        log.info("%s listening on %s:%d, loading its models%s", service, listening.host, port, source)
        await plane.load()
        await set_serving(self.health, True)
        models = ", ".join(plane.model_names) or "no model"
        log.info("%s serving %s on %s:%d", service, models, listening.host, port)

    async def close(self) -> None:
        """Unload the models and close the link to the router."""
        await self.plane.unload()
        if self.plane.router is not None:
            await self.plane.router.close()


async def serve_stages(
    stages: Sequence[Stage],
    settings: ProcessSettings,
    *,
    service: str,
    stopping: asyncio.Event | None = None,
    bound: Callable[[int], None] | None = None,
    telemetry: Telemetry | None = None,
    metrics: Metrics | None = None,
    repository: ModelRepository | None = None,
    backends: Sequence[Backend] = (),
    models: Sequence[str] | None = None,
    own: Sequence[str] | None = None,
) -> None:
    """Serve stage models until a signal (or `stopping`): listen first, load the models, then SERVING.

    The models are the `stages` objects, and the entries of `repository` whose backend is one of
    `backends` (`models`: only those named at start-up; `own`: those the service runs, loaded at start-up
    or not, default `models`). `bound` is called with the port once the server listens
    (tests and launchers ask for port 0). `telemetry` defaults to tracing configured by the environment
    (`Telemetry.from_env`), `metrics` to a registry of this server's own.
    """
    owned = telemetry is None
    telemetry = Telemetry.from_env(service) if telemetry is None else telemetry
    policy = access_policy_of(settings.group(Security), stage_token=settings.group(StageToken))
    plane = StagePlane(
        stages,
        repository=repository,
        backends=backends,
        models=models,
        own=own,
        telemetry=telemetry,
        metrics=Metrics() if metrics is None else metrics,
        control=model_control_of(settings.group(ModelControl), settings.group(Instances), policy),
        router=_router_calls(settings),
    )
    stage = _StageServer(plane, settings, service, policy)
    listening = settings.group(Listening)
    server = await stage.listen(
        f"{listening.host}:{listening.port}",
        credentials=server_credentials_of(stage.security),
        interceptors=interceptors_of(policy),
    )
    # The metric families its models make (Triton's custom metrics) are the process's: shown on its /metrics,
    # and given to the router, which shows every stage's on its own.
    plane.metrics.export_families(_model_families)
    server.add_generic_rpc_handlers((families_handler(_model_families),))
    await stage.run(stopping=stopping, bound=bound, telemetry=telemetry if owned else None)


async def _model_families() -> list[Snapshot]:
    """The metric families this process's models made."""
    return MODEL_FAMILIES.snapshot()


def _router_calls(settings: ProcessSettings) -> RouterClient | None:
    """Where the service's models send their calls to other models (`--router`), if anywhere: over TLS
    where the service trusts a CA (`--tls-ca`), presenting its own certificate, with the clients' token
    `PIPELINE_TOKEN` where one is set."""
    link = settings.group(RouterLink)
    if link.router is None and link.router_port_file is None:
        return None
    listening, limits, security = settings.group(Listening), settings.group(Limits), settings.group(Security)
    ca = security.tls_ca
    tls = client_tls(ca, security.tls_cert, security.tls_key) if ca else None
    return RouterClient(
        link.router,
        port_file=link.router_port_file,
        host=listening.host,
        max_message_bytes=limits.max_message_bytes,
        credentials=None if tls is None else tls.credentials,
        tls=None if tls is None else tls.ssl_context,
        token=link.router_token,
    )


def run_stage_service(
    stages: Sequence[Stage],
    settings: ProcessSettings,
    *,
    service: str,
    repository: ModelRepository | None = None,
    backends: Sequence[Backend] = (),
    models: Sequence[str] | None = None,
    own: Sequence[str] | None = None,
) -> None:
    """Entry point of a stage service process: serve `stages` and the repository models of `backends` until
    SIGTERM or SIGINT (`models` and `own` as `serve_stages`')."""
    prepare_process(settings.group(Logging).level, service)
    try:
        uvloop.run(
            serve_stages(
                stages,
                settings,
                service=service,
                repository=repository,
                backends=backends,
                models=models,
                own=own,
            )
        )
    except SecurityConfigError as err:
        log.error("%s", err)
        raise SystemExit(2) from None


def python_service_parser(service: str) -> argparse.ArgumentParser:
    """The command line of a Python stage service (`pipeline.runtime.settings.stage_settings`): the shared
    server flags, the repository's and `--ensembles`."""
    parser = argparse.ArgumentParser(
        prog=f"python -m services.{service}",
        description=f"Serve the Python models (model.py) of a model repository that run in the {service} "
        "service of their ensembles, over the Open Inference Protocol.",
    )
    add_arguments(parser, service_settings.stage_settings(service))
    return parser


def python_service_main(service: str, argv: Sequence[str] | None = None) -> None:
    """The `preprocess` and `postprocess` services: serve the repository's Python models that run there
    (`pipeline.stage.placement`, or those `--load-model` names) until SIGTERM or SIGINT."""
    settings = service_settings.stage_settings(service).parse(python_service_parser(service), argv)
    repository = ModelRepository(settings.group(Repository).model_dir)
    placed = _placed_models(service, repository, settings.group(StageEnsembles).ensembles)
    named = repository_models(settings.group(Loading))
    run_stage_service(
        [],
        settings,
        service=service,
        repository=repository,
        backends=[PythonBackend()],
        models=placed if named is None else named,
        own=sorted({*placed, *(named or ())}),  # it runs those placed here, and loads those named at start-up
    )


def _placed_models(service: str, repository: ModelRepository, ensembles: Sequence[Path]) -> list[str]:
    """The Python models the ensembles place in `service`; where the ensembles cannot be read (the router
    refuses them with the reason), every Python model but those the model service runs."""
    try:
        plans = ensemble_plans(ensembles, repository=repository.root)
    except ConfigError as err:
        log.warning("cannot read the ensembles to place the python models, so serving all of them: %s", err)
        return unplaced_python_models(repository)
    models = python_models_of(service, repository, plans)
    log.info(
        "%s serves the python models %s (where their ensembles run them; --load-model chooses otherwise)",
        service,
        ", ".join(models) or "(none)",
    )
    return models

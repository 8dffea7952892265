"""Run stage services and the router in-process on ports the OS picks: for tests, ours and yours.

    async with serving_stages([MyStage()]) as stage:
        ...  # call stage.address with any OIP client

Both go through the same code paths as the service processes (`serve_stages`, `serve_router`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.router.main import serve_router
from pipeline.runtime.router_settings import RouterSettings
from pipeline.runtime.service_settings import stage_settings
from pipeline.runtime.settings_cli import ProcessSettings
from pipeline.stage.api import Stage
from pipeline.stage.service import serve_stages

if TYPE_CHECKING:
    from pipeline.ensemble.plan import Catalog
    from pipeline.router.stages.targets import Resolve
    from pipeline.runtime.metrics import Metrics
    from pipeline.runtime.repository import ModelRepository
    from pipeline.runtime.telemetry import Telemetry
    from pipeline.stage.backend import Backend


@dataclass
class Running:
    """A server running in this event loop: its address, and `stop()` to drain and stop it."""

    address: str
    stopping: asyncio.Event
    task: asyncio.Task[None]
    #: host:port of the router's HTTP/REST side (None for a stage server, or with `http_port` off).
    http_address: str | None = None

    async def stop(self) -> None:
        """Drain and stop the server (what SIGTERM does to a service process)."""
        self.stopping.set()
        await self.task


#: What an in-process server is given unless told otherwise: no frame port, no Prometheus port, no drain
#: delay; a router with no limit on the requests it holds or their items, and its own gRPC server.
_STAGE_DEFAULTS: dict[str, Any] = {"frames_port": None, "metrics_port": None, "drain_delay": 0.0}
_ROUTER_DEFAULTS: dict[str, Any] = {
    **_STAGE_DEFAULTS,
    "max_inflight_requests": 0,
    "max_batch_items": 0,
    "front": "python",
}


def router_settings_of(**options: Any) -> ProcessSettings:
    """The settings of an in-process router on 127.0.0.1 and a port the OS picks, serving no HTTP/REST
    and no metrics unless `options` (settings by their field names) say otherwise: for a test that calls
    `serve_router` itself."""
    given = {"max_message_mb": 64, "grace_period": 5.0, "http_port": None, **options}
    mb, grace = given.pop("max_message_mb"), given.pop("grace_period")
    return _settings(RouterSettings, _ROUTER_DEFAULTS, mb, grace, options=given)


def _settings(
    model: type[ProcessSettings],
    defaults: Mapping[str, Any],
    max_message_mb: int,
    grace: float,
    port: int = 0,
    metrics_port: int | None = None,
    options: Mapping[str, Any] | None = None,
) -> ProcessSettings:
    """A server's settings model on 127.0.0.1; `options` sets further settings by their field names."""
    given = {
        **defaults,
        "host": "127.0.0.1",
        "port": port,
        "max_message_mb": max_message_mb,
        "grace_period": grace,
        "metrics_port": metrics_port,
        **(options or {}),
    }
    return model(**given)


@contextlib.asynccontextmanager
async def _running(
    serve: Callable[[asyncio.Event, Callable[[int], None]], Coroutine[Any, Any, None]],
) -> AsyncIterator[Running]:
    stopping = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(stopping, port.set_result))
    first: set[asyncio.Future[Any]] = {task, port}
    done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # it failed before listening: raise its error
    running = Running(f"127.0.0.1:{port.result()}", stopping, task)
    try:
        yield running
    finally:
        if not task.done():
            await running.stop()


@contextlib.asynccontextmanager
async def serving_stages(
    stages: Sequence[Stage],
    *,
    max_message_mb: int = 64,
    grace: float = 5.0,
    port: int = 0,
    telemetry: Telemetry | None = None,
    metrics: Metrics | None = None,
    metrics_port: int | None = None,
    drain_delay: float = 0.0,
    options: Mapping[str, Any] | None = None,
    repository: ModelRepository | None = None,
    backends: Sequence[Backend] = (),
    models: Sequence[str] | None = None,
) -> AsyncIterator[Running]:
    """Serve stage models on 127.0.0.1 and a port the OS picks (models load in the background): the
    `stages` objects, and the entries of `repository` that `backends` run (`models`: only those named).

    `port` asks for a given port instead, e.g. to bring a stopped stage back where it was. `telemetry`
    (tracing) defaults to what the environment says; `metrics_port` (0: the OS picks) serves `metrics`.
    `drain_delay` is how long `stop()` keeps serving while reporting NOT_SERVING. `options` sets further
    settings by their field names, e.g. `{"tls_cert": ..., "tls_key": ...}` (a Python stage service's
    settings: `pipeline.runtime.service_settings.stage_settings`).
    """
    settings = _settings(
        stage_settings("preprocess"),
        {**_STAGE_DEFAULTS, "drain_delay": drain_delay},
        max_message_mb,
        grace,
        port,
        metrics_port,
        options,
    )
    async with _running(
        lambda stopping, bound: serve_stages(
            stages,
            settings,
            service="stage",
            stopping=stopping,
            bound=bound,
            telemetry=telemetry,
            metrics=metrics,
            repository=repository,
            backends=backends,
            models=models,
        )
    ) as running:
        yield running


@contextlib.asynccontextmanager
async def serving_router(
    catalog: Catalog,
    *,
    max_message_mb: int = 64,
    grace: float = 5.0,
    telemetry: Telemetry | None = None,
    metrics: Metrics | None = None,
    metrics_port: int | None = None,
    options: Mapping[str, Any] | None = None,
    resolve: Resolve | None = None,
) -> AsyncIterator[Running]:
    """Serve a catalog's ensembles on 127.0.0.1 and a port the OS picks, gRPC at `address` and HTTP/REST
    at `http_address` (`telemetry`, `metrics`, `metrics_port` and `options` as for `serving_stages`;
    router flags such as `max_inflight_requests`, `auth_tokens_file`, `stage_tls_ca` or `http_port` by
    their attribute names). `resolve` looks up the stages' DNS names instead of the system's resolver."""

    settings = _settings(
        RouterSettings,
        _ROUTER_DEFAULTS,
        max_message_mb,
        grace,
        metrics_port=metrics_port,
        options={"http_port": 0, **(options or {})},
    )
    http_ports: list[int] = []
    async with _running(
        lambda stopping, bound: serve_router(
            settings,
            catalog=catalog,
            stopping=stopping,
            bound=bound,
            telemetry=telemetry,
            metrics=metrics,
            http_bound=http_ports.append,
            resolve=resolve,
        )
    ) as running:
        if http_ports:  # the HTTP site listens before the gRPC port is reported
            running.http_address = f"127.0.0.1:{http_ports[0]}"
        yield running

"""Run stage services and the router in-process on ports the OS picks: for tests, ours and yours.

    async with serving_stages([MyStage()]) as stage:
        ...  # call stage.address with any OIP client

Both go through the same code paths as the service processes (`serve_stages`, `serve_router`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.router.main import serve_router
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


def _args(
    max_message_mb: int,
    grace: float,
    port: int = 0,
    metrics_port: int | None = None,
    options: Mapping[str, Any] | None = None,
) -> argparse.Namespace:
    return argparse.Namespace(
        host="127.0.0.1",
        port=port,
        port_file=None,
        max_message_mb=max_message_mb,
        grace_period=grace,
        metrics_port=metrics_port,
        **(options or {}),
    )


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
    flags by their attribute names, e.g. `{"tls_cert": ..., "tls_key": ...}`.
    """
    args = _args(max_message_mb, grace, port, metrics_port, options)
    args.drain_delay = drain_delay
    async with _running(
        lambda stopping, bound: serve_stages(
            stages,
            args,
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

    args = _args(
        max_message_mb, grace, metrics_port=metrics_port, options={"http_port": 0, **(options or {})}
    )
    http_ports: list[int] = []
    async with _running(
        lambda stopping, bound: serve_router(
            args,
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

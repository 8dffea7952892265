"""One server's life, the same for the router and every stage service: listen, start, serve, drain, stop.

`ServerLifecycle` holds a server's `InferenceHandler` and its doors: the gRPC server (the handler's
`InferenceServicer`, with health and reflection) and the `Door`s beside it (the frame port, the router's
HTTP/REST and compiled front). A process says what is its own (`ready`: load its models or find its stages,
then report SERVING; `close`: what `ready` started) and the rest is here, once.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health

from pipeline.runtime.allocator import give_back_when_idle
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.server import (
    create_server,
    set_serving,
    settle_garbage_collection,
    start_metrics,
    write_port,
)
from pipeline.runtime.server_settings import Limits, Listening, Shutdown
from pipeline.runtime.servicer import InferenceServicer
from pipeline.runtime.settings_cli import ProcessSettings
from pipeline.runtime.shutdown import ABANDON_S, CLOSE_S, exit_deadline, exit_within
from pipeline.runtime.telemetry import Telemetry

log = logging.getLogger(__name__)


class Door(Protocol):
    """A port a server serves beside its gRPC port, over the same handler: the frame port
    (`pipeline.transport.FrameServer`), the router's HTTP/REST and its compiled front."""

    async def open(self, port: int) -> int:
        """Listen. `port`: the server's public port so far; returns it (or the door's own, where the door
        serves the public port itself: the compiled front)."""
        ...

    async def close(self, grace: float) -> None:
        """Refuse new requests and give those in flight `grace` seconds."""
        ...


class ServerLifecycle(abc.ABC):
    """A server process's life around its `handler`: `listen` (gRPC, NOT_SERVING), then `run`: start (its
    metrics port, each of its `doors` in order, its port written for launchers and tests, then `ready`),
    serve until it is told to stop, drain (gRPC and every door at once), stop (`close`, the metrics, the
    tracing it owns)."""

    def __init__(
        self, handler: InferenceHandler, settings: ProcessSettings, doors: Sequence[Door] = ()
    ) -> None:
        self.handler = handler
        self.listening = settings.group(Listening)
        self.limits = settings.group(Limits)
        self.shutdown = settings.group(Shutdown)
        self.doors = list(doors)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        #: The gRPC server's port, once it listens.
        self.port = 0

    @abc.abstractmethod
    async def ready(self, port: int) -> None:
        """What the process does once its doors are open (`port`: its public port): load its models or find
        its stages, then report SERVING."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop what `ready` started, once every door is drained."""

    async def listen(
        self,
        address: str,
        *,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        reuse_port: bool = False,
    ) -> grpc.aio.Server:
        """The gRPC server over the handler, NOT_SERVING, listening at `address` with `credentials` (TLS)
        and `interceptors` (not started yet: `run` starts it)."""
        await set_serving(self.health, False)
        self.server, self.port = await create_server(
            address,
            InferenceServicer(self.handler),
            self.health,
            max_message_bytes=self.limits.max_message_bytes,
            max_connection_age_s=self.limits.max_connection_age_s,
            credentials=credentials,
            interceptors=interceptors,
            reuse_port=reuse_port,
        )
        return self.server

    async def run(
        self,
        *,
        stopping: asyncio.Event | None = None,
        bound: Callable[[int], None] | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        """Serve until `stopping` is set (by default: SIGTERM or SIGINT), then drain and stop. `bound` is
        called with the public port once every door is open; `telemetry`: the tracing to shut down at the
        end, where the process owns it.

        Draining reports NOT_SERVING first and keeps serving for `--drain-delay` seconds, so that clients
        that watch health (the router does) move to other replicas before any call is refused; then it
        refuses new RPCs and gives in-flight ones `--grace-period` seconds, those of every door too, at the
        same time; then answers the requests still held UNAVAILABLE and closes every call and connection
        `ABANDON_S` later; then stops. Where it stops on a signal (the process's own server), the process
        exits within `exit_deadline` of it, whatever its threads do (`pipeline.runtime.shutdown`)."""
        assert self.server is not None, "listen first"
        loop = asyncio.get_running_loop()
        signals: tuple[signal.Signals, ...] = ()
        if stopping is None:
            stopping = asyncio.Event()
            signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, stopping.set)
        await self.server.start()
        trimming: asyncio.Task[None] | None = None
        try:
            await _start_unless_stopped(lambda: self._start(bound), stopping)
            settle_garbage_collection()
            trimming = asyncio.create_task(give_back_when_idle(self.handler.held))
            await stopping.wait()
        finally:
            if trimming is not None:
                trimming.cancel()
            await self._drain(bool(signals))
            await self._stop(telemetry)
            for sig in signals:
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(sig)

    async def _start(self, bound: Callable[[int], None] | None) -> None:
        start_metrics(self.handler.metrics, self.listening)
        port = self.port
        for door in self.doors:
            port = await door.open(port)
        write_port(self.listening.port_file, port)
        if bound is not None:
            bound(port)
        await self.ready(port)

    async def _drain(self, watched: bool) -> None:
        """Report NOT_SERVING, wait the drain delay, then refuse new calls and give those in flight the grace
        period, on every door too; then answer what is still held UNAVAILABLE, and close every call and
        connection `ABANDON_S` later. `watched`: the process exits within `exit_deadline` of now."""
        assert self.server is not None
        grace, drain_delay = self.shutdown.grace_period, self.shutdown.drain_delay
        bound = exit_deadline(drain_delay, grace)
        watchdog = exit_within(bound, f"stopping ({bound:.0f}s allowed)") if watched else None
        log.info("shutting down: draining in-flight requests (grace %.1fs)", grace)
        await self.health.enter_graceful_shutdown()
        if drain_delay > 0:
            await asyncio.sleep(drain_delay)
        within = grace + ABANDON_S
        closing = asyncio.gather(self.server.stop(within), *(door.close(within) for door in self.doors))
        done, _ = await asyncio.wait((closing,), timeout=grace)
        if not done and (count := self.handler.held.abandon()):
            log.warning("%d requests still held after the grace period: answered UNAVAILABLE", count)
        await closing
        if watchdog is not None:
            # Nothing is held any more: closing (and the threads' end) gets what is left of the margin, from
            # now, however soon the drain ended.
            watchdog.cancel()
            exit_within(CLOSE_S, "closing after the drain")

    async def _stop(self, telemetry: Telemetry | None) -> None:
        await self.close()
        self.handler.metrics.close()
        if telemetry is not None:
            # Flushing may wait on an exporter's endpoint: not on the event loop.
            await asyncio.to_thread(telemetry.shutdown)


async def _start_unless_stopped(
    start: Callable[[], Coroutine[Any, Any, None]], stopping: asyncio.Event
) -> None:
    """Run `start` to its end, unless `stopping` is set first (then `start` is cancelled)."""
    starting = asyncio.create_task(start())
    waiting = asyncio.create_task(stopping.wait())
    await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
    else:
        waiting.cancel()
        starting.result()

"""The compiled front door: `pipeline-front` (the `front/` folder, C++ on grpc++) owns the router's public gRPC
port, and the router's own gRPC server listens on loopback behind it.

Accepting a gRPC call costs Python several times what it costs grpc++, so the front takes the calls and moves
bytes: each `ModelInfer` goes to the router's door (a frame port on loopback, `pipeline.protocol.frames`, that
only the front may use: its hello carries a secret made at each start) with the request's bytes unparsed and
the call's deadline, trace context and credentials appended as parameters; every other RPC is forwarded as it
is to the router's own gRPC port. Every check stays in the router, in one place: the door's requests go
through the router's `InferenceHandler` as gRPC's do, their credentials checked by the same access policy
(`FrameServer`, `AuthInterceptor`: a verified client certificate's identities travel with the secret).
Where the router says it may (`DataPlane.front_batch`: a stage model it batches, an ensemble whose every
step it batches), the front
merges requests that wait behind the ones the router holds into one request (`front/src/batches.h`), so
that the router's per-request work is done once per batch.

`--front auto` (the default) serves with the front where its binary is there (`pipeline-front` beside the
interpreter or on `PATH`, or `PIPELINE_FRONT_BINARY`), and says in one line that the Python ingress serves
where it is not; `compiled` requires it; `python` never uses it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.protocol.errors import ConfigError
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.router_settings import Front as FrontSettings
from pipeline.runtime.server import write_port
from pipeline.runtime.server_settings import Limits, Listening, Security, Shutdown
from pipeline.runtime.settings_cli import ProcessSettings
from pipeline.runtime.shutdown import ABANDON_S, child_environment
from pipeline.transport import FrameServer

log = logging.getLogger(__name__)

#: The binary's name, and the variable naming another one.
BINARY = "pipeline-front"
BINARY_ENV = "PIPELINE_FRONT_BINARY"
#: The variable that hands the door's secret to the front (never its command line, which anyone may read).
SECRET_ENV = "PIPELINE_FRONT_SECRET"
#: Set by the parent of `--workers N` (`pipeline.router.workers`) in each worker's environment, with the
#: secret: the file where the worker writes its door's port.
DOOR_FILE_ENV = "PIPELINE_FRONT_DOOR_FILE"
#: Where the router's gRPC server and door listen when the front serves: loopback only.
LOOPBACK = "127.0.0.1"
#: Seconds the front gets to open its door connections and listen.
START_TIMEOUT_S = 30.0
#: Frame connections the front opens to each router process.
CONNECTIONS = 2
#: Bytes a door's frame may carry past the largest message: the hop's parameters the front appends.
HOP_BYTES = 64 * 1024
#: How long past the router's grace period the front keeps its calls open: the router answers what it still
#: holds UNAVAILABLE at the end of its grace period, and those answers must reach the clients before the
#: front cancels what is left.
FRONT_GRACE_MARGIN_S = ABANDON_S / 2


def binary() -> Path | None:
    """The front's binary: `PIPELINE_FRONT_BINARY`, else `pipeline-front` beside the interpreter (where the
    project's commands install it into the virtual environment), else on `PATH`; None where there is none."""
    named = os.environ.get(BINARY_ENV)
    if named:
        return Path(named) if os.access(named, os.X_OK) else None
    beside = Path(sys.executable).parent / BINARY
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(BINARY)
    return Path(found) if found else None


def compiled(choice: str) -> Path | None:
    """The binary to serve with for `--front choice`, or None where the Python ingress serves: `auto` says so
    in one line where there is no binary; `compiled` without one is a configuration error."""
    if choice == "python":
        return None
    found = binary()
    if found is None:
        if choice == "compiled":
            raise ConfigError(
                f"--front compiled: no {BINARY} binary (build it with `make front`, or name it in {BINARY_ENV})"
            )
        log.info("no %s binary (make front builds it): the Python ingress serves the gRPC port", BINARY)
    return found


def new_secret() -> str:
    """A door secret, made at each start."""
    return secrets.token_urlsafe(32)


class FrontProcess:
    """The front's process: started once the router's gRPC server and door listen, stopped (drained) first.
    It is started from the thread that runs the router (Linux ends it with that thread: `child_environment`)."""

    def __init__(self, path: Path, secret: str) -> None:
        self.path, self.secret = path, secret
        self.process: subprocess.Popen[bytes] | None = None
        self._folder = Path(tempfile.mkdtemp(prefix="pipeline-front-"))
        self._port_file = self._folder / "port"

    def command(self, settings: ProcessSettings, router_port: int, doors: list[int]) -> list[str]:
        """The front's command line: the public address, the router's loopback ports, limits and TLS files."""
        listening, security = settings.group(Listening), settings.group(Security)
        command = [
            str(self.path),
            "--listen",
            f"{listening.host}:{listening.port}",
            "--router",
            f"{LOOPBACK}:{router_port}",
        ]
        for door in doors:
            command += ["--door", f"{LOOPBACK}:{door}"]
        command += ["--connections", str(CONNECTIONS), "--port-file", str(self._port_file)]
        command += ["--max-message-bytes", str(settings.group(Limits).max_message_bytes)]
        command += ["--grace-seconds", str(settings.group(Shutdown).grace_period + FRONT_GRACE_MARGIN_S)]
        command += ["--merge-inflight", str(settings.group(FrontSettings).front_merge_inflight)]
        for flag, value in (
            ("--tls-cert", security.tls_cert),
            ("--tls-key", security.tls_key),
            ("--tls-ca", security.tls_ca),
        ):
            if value:
                command += [flag, str(value)]
        return command

    def launch(self, settings: ProcessSettings, router_port: int, doors: list[int]) -> None:
        """Start the front on the router's public address (`listening` then says when it listens)."""
        environment = child_environment({**os.environ, SECRET_ENV: self.secret})
        self.process = subprocess.Popen(self.command(settings, router_port, doors), env=environment)

    def listening(self) -> int | None:
        """The port the front listens on, once it does; raises `ConfigError` where it exited instead."""
        assert self.process is not None
        if self._port_file.exists():
            port = int(self._port_file.read_text())
            shutil.rmtree(self._folder, ignore_errors=True)
            log.info("%s serves the gRPC port %d", BINARY, port)
            return port
        if self.process.poll() is not None:
            raise ConfigError(f"{BINARY} exited ({self.process.returncode}) before it listened")
        return None

    def wait_listening(self, timeout: float = START_TIMEOUT_S) -> int:
        """`listening`, waited for (a process that starts the front and serves nothing itself)."""
        deadline = time.monotonic() + timeout
        while (port := self.listening()) is None:
            if time.monotonic() > deadline:
                raise ConfigError(f"{BINARY} did not listen within {timeout:.0f} s")
            time.sleep(0.02)
        return port

    async def start(self, settings: ProcessSettings, router_port: int, doors: list[int]) -> int:
        """Start the front and wait until it listens, without holding up the event loop; returns its port."""
        self.launch(settings, router_port, doors)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while (port := self.listening()) is None:
            if loop.time() > deadline:
                raise ConfigError(f"{BINARY} did not listen within {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.02)
        return port

    async def stop(self, within: float) -> None:
        """Drain the front (SIGTERM: no new call, those in flight get its grace period) and wait for it,
        `within` seconds at most, then kill it."""
        process = self.process
        shutil.rmtree(self._folder, ignore_errors=True)
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.to_thread(process.wait), within)
        except TimeoutError:
            process.kill()
            await asyncio.to_thread(process.wait)


class CompiledFront:
    """A router process's side of the front, one of its doors (`pipeline.runtime.lifecycle.Door`): a frame
    port on loopback that takes the front's connections alone and, where this process starts it, the front's
    process. A worker of `--workers N` (`door_file`: where it writes its door's port) opens its door only: the
    parent starts the front, in front of every worker's door and of their shared gRPC port (their `--port`, on
    loopback)."""

    def __init__(
        self,
        path: Path,
        handler: InferenceHandler,
        settings: ProcessSettings,
        *,
        secret: str | None = None,
        door_file: Path | None = None,
    ):
        #: The door's secret: made at each start, or the parent's.
        self.secret = secret or new_secret()
        max_frame_bytes = settings.group(Limits).max_message_bytes + HOP_BYTES
        self.door = FrameServer(
            handler, max_frame_bytes=max_frame_bytes, door=self.secret, address=(LOOPBACK, 0)
        )
        self.door_file = door_file
        self.process = None if door_file is not None else FrontProcess(path, self.secret)
        #: Where the router's own gRPC server listens: the port the parent shares out, else one the OS picks.
        port = settings.group(Listening).port
        self.router_address = f"{LOOPBACK}:{port if door_file is not None else 0}"
        self.settings = settings

    async def open(self, port: int) -> int:
        """Open the door, then start the front before the router's gRPC server on `port`; returns the public
        port (a worker: its door's, written to its file, and `port`)."""
        await self.door.open(port)
        door = self.door.port
        assert door is not None
        if self.process is None:
            write_port(self.door_file, door)
            return port
        return await self.process.start(self.settings, port, [door])

    async def close(self, within: float) -> None:
        """Drain the front, then the door: what the front holds in flight is answered through it."""
        loop = asyncio.get_running_loop()
        until = loop.time() + within
        if self.process is not None:
            await self.process.stop(within)
        await self.door.close(max(0.0, until - loop.time()))


def front_of(settings: ProcessSettings, handler: InferenceHandler) -> CompiledFront | None:
    """The router's compiled front as `--front` says, or None where its own gRPC server serves; in a worker
    of `--workers N` behind the parent's front, its door alone."""
    door_file, secret = os.environ.get(DOOR_FILE_ENV), os.environ.get(SECRET_ENV)
    if door_file and secret:
        return CompiledFront(Path(BINARY), handler, settings, secret=secret, door_file=Path(door_file))
    path = compiled(settings.group(FrontSettings).front)
    return None if path is None else CompiledFront(path, handler, settings)

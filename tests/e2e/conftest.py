"""Real processes: the stage services and the router started as a user would, on ports the OS picks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    address: str
    #: The router's HTTP/REST host:port (None for a stage).
    http_address: str | None = None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        return self.popen.wait(timeout)


def start_service(
    name: str, command: list[str], tmp: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> Process:
    """Start `python <command> --port 0`; return once it listens (not yet necessarily SERVING). The router
    serves HTTP/REST on a port the OS picks too."""
    port_file = tmp / f"{name}.port"
    port_file.unlink(missing_ok=True)
    http_file = tmp / f"{name}.http-port"
    http = ["--http-port", "0", "--http-port-file", str(http_file)] if "router" in command else []
    log = open(tmp / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it while it runs
    popen = subprocess.Popen(
        [
            sys.executable,
            *command,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            *http,
        ],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if popen.poll() is not None:
            raise RuntimeError(f"{name} exited with {popen.returncode}: {(tmp / f'{name}.log').read_text()}")
        if time.monotonic() > deadline:
            popen.kill()
            raise TimeoutError(f"{name} did not listen within {timeout}s")
        time.sleep(0.05)
    # The HTTP port is written before the gRPC one.
    http_address = f"127.0.0.1:{int(http_file.read_text())}" if http else None
    return Process(name, popen, f"127.0.0.1:{int(port_file.read_text())}", http_address)


def wait_serving(process: Process, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(process.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            assert process.popen.poll() is None, f"{process.name} exited with {process.popen.returncode}"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"{process.name} not SERVING within {timeout}s"
            time.sleep(0.1)


@dataclass
class Pipeline:
    stages: dict[str, Process]
    router: Process
    tmp: Path
    #: Flags every stage gets (e.g. `--model-control-mode explicit`).
    stage_flags: tuple[str, ...] = ()

    def start_stage(self, name: str, port: int | None = None) -> Process:
        command = ["-m", f"services.{name}", "--model-dir", str(self.tmp / "models"), *self.stage_flags]
        process = start_service(name, command, self.tmp)
        if port is not None:  # bring it back where the router expects it
            process.stop()
            process = _start_on_port(name, command, self.tmp, port)
        self.stages[name] = process
        return process

    def stop(self) -> None:
        for process in [self.router, *self.stages.values()]:
            if process.popen.poll() is None:
                process.stop()


def _start_on_port(name: str, command: list[str], tmp: Path, port: int) -> Process:
    popen = subprocess.Popen(
        [sys.executable, *command, "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        stdout=open(tmp / f"{name}.log", "ab"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    return Process(name, popen, f"127.0.0.1:{port}")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A copy of the tree's model repository (its stages and configs) with the example models built."""
    from examples.models.build import build

    folder = tmp_path_factory.mktemp("models")
    shutil.copytree(REPO / "model_repository", folder, dirs_exist_ok=True, ignore=ARTIFACTS)
    build(folder, progress=False, report=lambda _: None)
    return folder


#: What a copy of the tree's repository leaves out: files `make model` writes, and caches.
ARTIFACTS = shutil.ignore_patterns("model.pt", "model.pt2", "model.onnx", ".engines", "__pycache__")


def start_pipeline(
    tmp: Path,
    model_dir: Path,
    *,
    max_message_mb: int = 16,
    stage_flags: Sequence[str] = (),
    router_flags: Sequence[str] = (),
) -> Pipeline:
    """The three stages and the router on `model_dir`; `stage_flags` go to every stage, `router_flags` to
    the router."""
    (tmp / "models").symlink_to(model_dir, target_is_directory=True)
    pipeline = Pipeline({}, None, tmp)  # type: ignore[arg-type]
    pipeline.stage_flags = tuple(stage_flags)
    for name in ("preprocess", "model", "postprocess"):
        pipeline.start_stage(name)
    env = {f"{name.upper()}_ADDRESS": p.address for name, p in pipeline.stages.items()}
    pipeline.router = start_service(
        "router",
        [
            "-m",
            "pipeline",
            "router",
            "--model-dir",
            str(tmp / "models"),
            "--max-message-mb",
            str(max_message_mb),
            *router_flags,
        ],
        tmp,
        env,
    )
    wait_serving(pipeline.router)
    return pipeline


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, model_dir) -> Iterator[Pipeline]:
    """The four processes of the digits pipeline, shared by a module's tests."""
    running = start_pipeline(tmp_path_factory.mktemp("pipeline"), model_dir)
    try:
        yield running
    finally:
        running.stop()

"""TorchServe 0.12 started from its virtual environment, for the parity record (`tests.torchserve.record`) and
the benchmark (`bench.torchserve`).

    python3 -m venv TS_HOME && TS_HOME/bin/pip install torch==2.13.0 && \
        TS_HOME/bin/pip install torchserve==0.12.0 torch-model-archiver pyyaml numpy   # the CPU build of torch

TorchServe (it needs Java 17) runs on 127.0.0.1 and ports the OS has free, with its model API enabled, token
authorization off, one worker per model by default and no configuration snapshots, its logs in the work
folder; it is stopped (its whole process group) when the `with` block ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.parity.record import free_ports

#: TorchServe's settings of every run here; `serve` adds the addresses and the caller's own lines.
PROPERTIES = (
    "default_workers_per_model=1\ninstall_py_dep_per_model=false\ndisable_system_metrics=true\n"
    "enable_model_api=true\nvmargs=-Xmx1g -XX:+UseSerialGC\n"
)


@dataclass(frozen=True)
class TorchServe:
    """A running TorchServe: its Inference and Management APIs' URLs and its process (a group leader)."""

    inference: str
    management: str
    process: subprocess.Popen[bytes]
    config: Path


def version(home: Path) -> str:
    """The version of TorchServe installed in `home`."""
    return subprocess.run(
        [str(home / "bin" / "python"), "-c", "import ts; print(ts.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@contextlib.contextmanager
def serve(
    home: Path, store: Path, work: Path, properties: str = "", ready: str = "/ping", timeout: float = 180
) -> Iterator[TorchServe]:
    """TorchServe of the venv `home` on the model store `store`, its config.properties (with `properties`
    added: e.g. `load_models` and `models`) and logs in `work`; ready once `ready` (a path of its Inference
    API) answers 200."""
    inference, management, metrics, grpc_inference, grpc_management = free_ports(5)
    config = work / "config.properties"
    config.write_text(
        f"inference_address=http://127.0.0.1:{inference}\n"
        f"management_address=http://127.0.0.1:{management}\n"
        f"metrics_address=http://127.0.0.1:{metrics}\n"
        f"grpc_inference_port={grpc_inference}\ngrpc_management_port={grpc_management}\n"
        f"{PROPERTIES}{properties}"
    )
    env = {
        **os.environ,
        "PATH": f"{home / 'bin'}:{os.environ['PATH']}",
        "LOG_LOCATION": str(work / "logs"),
        "METRICS_LOCATION": str(work / "logs"),
    }
    command = [str(home / "bin" / "torchserve"), "--start", "--foreground", "--ncs", "--disable-token-auth"]
    command += ["--ts-config", str(config), "--model-store", str(store)]
    with open(work / "torchserve.log", "wb") as log:
        process = subprocess.Popen(
            command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        server = TorchServe(
            f"http://127.0.0.1:{inference}", f"http://127.0.0.1:{management}", process, config
        )
        _wait(server.inference + ready, process, timeout)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait(url: str, server: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"torchserve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"torchserve did not answer {url} in {timeout:.0f} s")

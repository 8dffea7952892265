"""Record TorchServe 0.12's answers to the parity requests (`tests.torchserve.exchange`) into
`torchserve_answers.json`, which `tests/e2e/test_torchserve_parity.py` compares the pipeline's answers with.

    python3 -m venv TS_HOME && TS_HOME/bin/pip install torch==2.13.0 && \
        TS_HOME/bin/pip install torchserve==0.12.0 torch-model-archiver pyyaml numpy   # the CPU build of torch
    python -m tests.torchserve.record --torchserve-home TS_HOME

TorchServe (it needs Java 17) runs on 127.0.0.1 and ports the OS has free, with its model API enabled, token
authorization off and one worker per model by default; the word handler's archive is made by that
environment's `torch-model-archiver`. The server is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.torchserve.archive import archive_with_archiver
from tests.torchserve.exchange import ANSWERS, exchange


def _free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--torchserve-home", type=Path, required=True, help="venv with torchserve 0.12")
    args = parser.parse_args()
    home = args.torchserve_home.resolve()
    with tempfile.TemporaryDirectory(prefix="torchserve-parity-") as folder:
        work = Path(folder)
        store = work / "store"
        archive_with_archiver(home / "bin" / "torch-model-archiver", store)
        inference, management, metrics, grpc_inference, grpc_management = _free_ports(5)
        (work / "config.properties").write_text(
            f"inference_address=http://127.0.0.1:{inference}\n"
            f"management_address=http://127.0.0.1:{management}\n"
            f"metrics_address=http://127.0.0.1:{metrics}\n"
            f"grpc_inference_port={grpc_inference}\ngrpc_management_port={grpc_management}\n"
            "default_workers_per_model=1\ninstall_py_dep_per_model=false\ndisable_system_metrics=true\n"
            "enable_model_api=true\nvmargs=-Xmx1g -XX:+UseSerialGC\n"
        )
        env = {
            **os.environ,
            "PATH": f"{home / 'bin'}:{os.environ['PATH']}",
            "LOG_LOCATION": str(work / "logs"),
            "METRICS_LOCATION": str(work / "logs"),
        }
        server = subprocess.Popen(
            [
                str(home / "bin" / "torchserve"),
                "--start",
                "--foreground",
                "--ncs",
                "--disable-token-auth",
                "--ts-config",
                str(work / "config.properties"),
                "--model-store",
                str(store),
            ],
            cwd=work,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait(f"http://127.0.0.1:{inference}/ping", server)
            answers = exchange(f"http://127.0.0.1:{inference}", f"http://127.0.0.1:{management}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
    version = subprocess.run(
        [str(home / "bin" / "python"), "-c", "import ts; print(ts.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ANSWERS.write_text(
        json.dumps({"server": "torchserve", "version": version, "answers": answers}, indent=1) + "\n"
    )
    print(f"wrote {ANSWERS} ({len(answers)} answers of TorchServe {version})", file=sys.stderr)


def _wait(url: str, server: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"torchserve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit("torchserve did not answer /ping in time")


if __name__ == "__main__":
    main()

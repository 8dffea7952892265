"""Record Triton's answers to the parity requests: start the real Triton server on `repository/` and write
what it answered to `triton_answers.json` (the parity test compares this project's answers with them).

    python3 -m venv TRITON_HOME && TRITON_HOME/bin/pip install nvidia-pytriton==0.7.0 numpy
    python -m tests.parity.record --triton-home TRITON_HOME

TRITON_HOME is a virtual environment holding the `nvidia-pytriton` wheel, which ships `tritonserver` and its
Python backend (PyTriton's own API is not used). Triton runs on CPU, on 127.0.0.1 and ports the OS has free,
on the repository as `tests.parity.lay_out` lays it out, and is stopped at the end. The requests are those
of `tests.parity.exchange`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.parity import HERE, lay_out

ANSWERS = HERE / "triton_answers.json"


def free_ports(count: int) -> list[int]:
    """`count` ports on 127.0.0.1 that the OS has free now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _python_version(home: Path) -> str:
    out = subprocess.run(
        [
            str(home / "bin" / "python3"),
            "-c",
            "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


@contextlib.contextmanager
def triton_server(
    home: Path, repository: Path, work: Path, timeout: float = 120
) -> Iterator[tuple[str, str, str]]:
    """Serve `repository` with the `tritonserver` of the environment `home`; yields its gRPC and HTTP/REST
    host:port, and its Prometheus metrics URL."""
    version = _python_version(home)
    site = home / "lib" / f"python{version}" / "site-packages"
    server = site / "pytriton" / "tritonserver"
    # The backend folder as Triton expects it; the stub is the one built for the environment's Python, which
    # finds numpy through the `python3` first on PATH (the environment's).
    backend = work / "backends" / "python"
    backend.mkdir(parents=True)
    for name, source in {
        "libtriton_python.so": server / "backends" / "python" / "libtriton_python.so",
        "triton_python_backend_utils.py": server / "backends" / "python" / "triton_python_backend_utils.py",
        "triton_python_backend_stub": server
        / "python_backend_stubs"
        / version
        / "triton_python_backend_stub",
    }.items():
        (backend / name).symlink_to(source)
    env = {
        **os.environ,
        "PATH": f"{home / 'bin'}:{os.environ.get('PATH', '')}",
        "LD_LIBRARY_PATH": ":".join(
            filter(None, [str(site / "nvidia_pytriton.libs"), os.environ.get("LD_LIBRARY_PATH")])
        ),
    }
    http, grpc_port, metrics = free_ports(3)
    log = work / "server.log"
    command = [
        str(server / "bin" / "tritonserver"),
        f"--model-repository={repository}",
        f"--backend-directory={work / 'backends'}",
        f"--cache-directory={server / 'caches'}",
        "--http-address=127.0.0.1",
        f"--http-port={http}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--metrics-address=127.0.0.1",
        f"--metrics-port={metrics}",
        "--allow-gpu-metrics=false",
        "--pinned-memory-pool-byte-size=0",
        "--exit-on-error=true",
        "--log-verbose=0",
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"127.0.0.1:{grpc_port}"
    try:
        import tritonclient.grpc as triton

        client = triton.InferenceServerClient(url)
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {process.returncode}:\n{log.read_text()}")
            with contextlib.suppress(Exception):
                if client.is_server_ready():
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"tritonserver not ready within {timeout} s:\n{log.read_text()}")
            time.sleep(0.5)
        yield url, f"127.0.0.1:{http}", f"http://127.0.0.1:{metrics}/metrics"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def record(home: Path, out: Path) -> dict:
    import tritonclient.grpc as triton

    from tests.parity.exchange import exchange

    with tempfile.TemporaryDirectory(prefix="triton-parity-") as scratch:
        work = Path(scratch)
        repository = lay_out(work / "repository")
        with triton_server(home, repository, work) as (url, http, metrics):
            metadata = triton.InferenceServerClient(url).get_server_metadata()
            answers = exchange(url, str(repository), http=http, metrics=metrics)
    report = {
        "server": metadata.name,
        "version": metadata.version,
        "recorded_with": "python -m tests.parity.record (nvidia-pytriton 0.7.0, CPU, Python backend)",
        "answers": answers,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--triton-home", type=Path, required=True, help="virtual environment with nvidia-pytriton"
    )
    parser.add_argument(
        "--out", type=Path, default=ANSWERS, help=f"where to write the answers (default {ANSWERS.name})"
    )
    args = parser.parse_args(argv)
    report = record(args.triton_home.resolve(), args.out)
    print(f"{report['server']} {report['version']}: {len(report['answers'])} answers written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

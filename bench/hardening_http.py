"""How long gRPC waits while the router's HTTP side takes abusive JSON: `python -m bench.hardening_http`.

The router's event loop serves gRPC and HTTP both. This starts the stages of the `refcnn` workload
(`refcnn_preprocess`, `refcnn_postprocess`) and a router as processes of their own, calls gRPC `ServerLive`
back to back from a thread, and meanwhile sends, four at once:

- **decode**: request bodies of about 120 KB of gzip that inflate to 60 MB of JSON strings (refused once
  parsed: the model takes FP32);
- **encode**: 3 KB requests (200 blank images, UINT8, gzip-compressed binary data) for `refcnn_preprocess`
  whose outputs, asked as JSON, take 44 MB each.

It prints the longest `ServerLive` of each, with the router's HTTP codec on its event loop
(`--http-codec-processes 0 --max-json-output-mb 0`: how the HTTP side worked before) and as it is by default
(worker processes, and the JSON output cap). `--scale 0.25` makes every body a quarter as large.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import aiohttp
import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]

#: The router's flags for each configuration measured.
CONFIGURATIONS = {
    "on the event loop": ["--http-codec-processes", "0", "--max-json-output-mb", "0"],
    "default": [],
}

ENSEMBLE = """
name: top1
stages:
  postprocess: {{address: "{postprocess}"}}
inputs: [{{name: LOGITS, datatype: FP32, shape: [-1, 10]}}]
outputs: [{{name: LABEL, datatype: INT64, shape: [-1, 1]}}]
steps:
  - {{model_name: refcnn_postprocess, stage: postprocess, input_map: {{LOGITS: LOGITS}}, output_map: {{LABEL: LABEL}}}}
"""


def _start(
    name: str, command: Sequence[str], folder: Path, http: bool = False
) -> tuple[subprocess.Popen, str, str]:
    """Start `python -m ...` on ports the OS picks; return it, its gRPC address and (router) HTTP address."""
    port_file, http_file = folder / f"{name}.port", folder / f"{name}.http-port"
    port_file.unlink(missing_ok=True)  # the previous router's
    flags = ["--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)]
    if http:
        flags += ["--http-port", "0", "--http-port-file", str(http_file)]
    log = open(folder / f"{name}.log", "wb")  # noqa: SIM115 - the process owns it while it runs
    process = subprocess.Popen(
        [sys.executable, *command, *flags], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{name} did not start: {(folder / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.05)
    address = f"127.0.0.1:{int(port_file.read_text())}"
    return process, address, f"127.0.0.1:{int(http_file.read_text())}" if http else ""


def _wait_serving(address: str, service: str = "") -> None:
    deadline = time.monotonic() + 120
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING")
            time.sleep(0.1)


@contextlib.contextmanager
def _stages(folder: Path) -> Iterator[dict[str, str]]:
    repository = str(REPO / "model_repository")
    started = {
        name: _start(
            name, ["-m", f"services.{name}", "--model-dir", repository, "--load-model", model], folder
        )
        for name, model in (("preprocess", "refcnn_preprocess"), ("postprocess", "refcnn_postprocess"))
    }
    try:
        for _, address, _ in started.values():
            _wait_serving(address)
        yield {name: address for name, (_, address, _) in started.items()}
    finally:
        for process, _, _ in started.values():
            process.terminate()
            process.wait(30)


@contextlib.contextmanager
def _router(folder: Path, stages: dict[str, str], flags: Sequence[str]) -> Iterator[tuple[str, str]]:
    (folder / "top1.yaml").write_text(ENSEMBLE.format(**stages))
    stage_flags = ["--stage", f"preprocess={stages['preprocess']}"]  # refcnn_preprocess is called directly
    command = ["-m", "pipeline", "router", "--ensembles", str(folder / "top1.yaml"), *stage_flags, *flags]
    process, address, http = _start("router", command, folder, http=True)
    try:
        try:
            _wait_serving(address, "inference.GRPCInferenceService")
        except TimeoutError:
            raise RuntimeError(
                f"the router is not ready: {(folder / 'router.log').read_text()[-3000:]}"
            ) from None
        yield address, http
    finally:
        process.terminate()
        process.wait(30)


class _Prober:
    """Calls `ServerLive` back to back from a thread of its own; keeps the longest call."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.stub.ServerLive(pb.ServerLiveRequest(), timeout=10)
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            self.stub.ServerLive(pb.ServerLiveRequest(), timeout=120)
            self.longest = max(self.longest, time.perf_counter() - started)

    def __enter__(self) -> _Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.channel.close()


def _bodies(scale: float) -> dict[str, tuple[str, bytes, dict[str, str]]]:
    """Each abuse: the model it calls, its body and headers."""
    count = int(4_300_000 * scale)  # "abcdefghij", 14 bytes of JSON each: 60 MB, under the 64 MB limit
    text = json.dumps(
        {
            "inputs": [
                {"name": "LOGITS", "datatype": "BYTES", "shape": [count, 1], "data": ["abcdefghij"] * count}
            ]
        }
    ).encode()
    strings = gzip.compress(text, compresslevel=9)
    images = np.zeros((max(1, int(200 * scale)), 3, 64, 64), np.uint8)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "IMAGE",
                    "datatype": "UINT8",
                    "shape": list(images.shape),
                    "parameters": {"binary_data_size": images.nbytes},
                }
            ]
        }
    ).encode()
    blank = gzip.compress(header + images.tobytes(), compresslevel=9)
    binary = {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}
    return {
        "decode": ("top1", strings, {"Content-Type": "application/json", "Content-Encoding": "gzip"}),
        "encode": (
            "refcnn_preprocess",
            blank,
            {**binary, "Content-Encoding": "gzip", "Accept-Encoding": "identity"},
        ),
    }


async def _abuse(
    http: str, model: str, body: bytes, headers: dict[str, str], copies: int
) -> list[tuple[int, int]]:
    """Send `copies` of a request at once; each answer's status and size."""
    url = f"http://{http}/v2/models/{model}/infer"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:

        async def one() -> tuple[int, int]:
            async with session.post(url, data=body, headers=headers) as reply:
                return reply.status, len(await reply.read())

        return await asyncio.gather(*(one() for _ in range(copies)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="the bodies' size, relative to the issue's")
    parser.add_argument("--copies", type=int, default=4, help="requests of each kind sent at once")
    args = parser.parse_args(argv)
    bodies = _bodies(args.scale)
    with tempfile.TemporaryDirectory() as tmp, _stages(Path(tmp)) as stages:
        print(f"{os.cpu_count()} CPUs; {args.copies} requests of each kind at once")
        for name, (model, body, _) in bodies.items():
            print(f"  {name}: {model}, {len(body) / 1024:.1f} KB bodies")
        for configuration, flags in CONFIGURATIONS.items():
            with _router(Path(tmp), stages, flags) as (address, http):
                for name, (model, body, headers) in bodies.items():
                    started = time.perf_counter()
                    with _Prober(address) as prober:
                        answers = asyncio.run(_abuse(http, model, body, headers, args.copies))
                    took = time.perf_counter() - started
                    statuses = ", ".join(f"{status} ({size / 2**20:.1f} MB)" for status, size in answers)
                    print(
                        f"{configuration:>18} | {name}: longest ServerLive {prober.longest:6.3f} s "
                        f"during {took:5.1f} s; answers {statuses}"
                    )


if __name__ == "__main__":
    main()

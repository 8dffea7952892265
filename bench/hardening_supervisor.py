"""One model replica SIGKILLed under load while `pipeline run --replicas model=2` supervises the pipeline:
`python -m bench.hardening_supervisor`.

Closed-loop clients send `digits` requests (4 images each, a 10 s deadline) to the router; after `--kill-at`
seconds the first model replica gets SIGKILL. The launcher starts it again on its port while the other
replica answers. Printed: the requests answered and failed (by code), how long the killed replica took to
serve again (its health SERVING) and to take calls from the router again (its own `ModelStatistics`), and
whether the launcher said so.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import Tensor
from pipeline.tools.client import bytes_batch

REPO = Path(__file__).resolve().parents[1]
#: What a stage process of the launcher's "serving" line looks like: `model-1 127.0.0.1:41234 (pid 567)`.
_STAGE = re.compile(r"([\w-]+) (\S+:\d+) \(pid (\d+)\)")
#: Each request's deadline.
DEADLINE = 10.0


@dataclass
class Launched:
    """`pipeline run` on ports the OS picks: its process, its output file, the router's and stages' addresses
    and the stages' process ids."""

    process: subprocess.Popen[bytes]
    log: Path
    router: str
    stages: dict[str, str]
    pids: dict[str, int]

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM (the launcher drains the router, then the stages); its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def launch(model_dir: Path, log: Path, *extra: str, timeout: float = 240.0) -> Launched:
    """Start `pipeline run --model-dir model_dir` (every port chosen by the OS), up to its "serving" line."""
    command = [sys.executable, "-m", "pipeline", "run", "--model-dir", str(model_dir), "--grace-period", "2"]
    for flag in ("--port", "--preprocess-port", "--model-port", "--postprocess-port", "--http-port"):
        command += [flag, "0"]
    with open(log, "wb") as out:
        process = subprocess.Popen([*command, *extra], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while (
        found := re.search(r"pipeline: serving .* on (\S+) \(gRPC.*", log.read_text(errors="replace"))
    ) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"`pipeline run` did not start:\n{tail}")
        time.sleep(0.1)
    stages = _STAGE.findall(found.group(0).split("stages:", 1)[1])
    return Launched(
        process,
        log,
        found.group(1),
        {name: address for name, address, _ in stages},
        {name: int(pid) for name, _, pid in stages},
    )


def digits_request(images: int) -> pb.ModelInferRequest:
    """A `digits` request of `images` held-out digits, each an 8x8 PNG file."""
    from examples.models.digits import load_split

    _, _, x_test, _ = load_split()
    files = []
    for i in range(images):
        grey = np.clip(x_test[i % len(x_test)].reshape(8, 8) * (255 / 16), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(grey, "L").save(out, format="PNG")
        files.append(out.getvalue())
    tensor = Tensor.from_array("IMAGE", bytes_batch(files, (-1, 1)))
    request = pb.ModelInferRequest(model_name="digits")
    request.inputs.add(name="IMAGE", datatype=tensor.datatype, shape=tensor.shape)
    request.raw_input_contents.append(tensor.raw)
    return request


async def load(
    address: str, request: pb.ModelInferRequest, clients: int, stop: asyncio.Event, outcomes: Counter[str]
) -> None:
    """`clients` closed-loop clients until `stop`, each outcome counted: OK, or the failure's status code."""

    async def client() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            while not stop.is_set():
                try:
                    await stub.ModelInfer(request, timeout=DEADLINE)
                    outcomes["OK"] += 1
                except grpc.aio.AioRpcError as err:
                    outcomes[err.code().name] += 1

    await asyncio.gather(*(client() for _ in range(clients)))


async def serving(address: str) -> bool:
    """Whether the server at `address` answers its health check with SERVING."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            # The stubs (types-grpcio-health-checking) declare HealthStub without its methods.
            reply = await health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def calls_served(address: str, model: str) -> int:
    """The requests a stage served of `model`, from its own `ModelStatistics` (0 while it cannot say)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=2.0)
        except grpc.aio.AioRpcError:
            return 0
    return sum(stats.inference_count for stats in reply.model_stats)


async def kill_under_load(
    launched: Launched, *, duration: float, kill_at: float, clients: int, victim: str = "model-1"
) -> dict[str, Any]:
    """Load the router for `duration` seconds, SIGKILL `victim` after `kill_at`; the figures."""
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()
    running = asyncio.create_task(load(launched.router, digits_request(4), clients, stop, outcomes))
    began = time.monotonic()
    await asyncio.sleep(kill_at)
    address = launched.stages[victim]
    os.kill(launched.pids[victim], signal.SIGKILL)
    killed = time.monotonic()
    answered_before = outcomes["OK"]
    back = taking_calls = None
    while time.monotonic() - began < duration or taking_calls is None:
        now = time.monotonic()
        if back is None and await serving(address):
            back = now - killed
        if back is not None and taking_calls is None and await calls_served(address, "digits_cnn") > 0:
            taking_calls = now - killed
        if now - killed > max(duration, 60):
            break  # it never came back: reported as such
        await asyncio.sleep(0.1)
    stop.set()
    await running
    elapsed = time.monotonic() - began
    failed = {code: n for code, n in outcomes.items() if code != "OK"}
    return {
        "clients": clients,
        "seconds": round(elapsed, 1),
        "answered": outcomes["OK"],
        "answered_before_the_kill": answered_before,
        "failed": sum(failed.values()),
        "failed_by_code": failed,
        "serving_again_s": None if back is None else round(back, 2),
        "taking_calls_again_s": None if taking_calls is None else round(taking_calls, 2),
        "launcher_said_so": f"{victim} (pid" in launched.output() and "is serving again" in launched.output(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hardening_supervisor", description=__doc__)
    parser.add_argument("--model-dir", type=Path, default=REPO / "model_repository")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load (default %(default)s)")
    parser.add_argument(
        "--kill-at", type=float, default=5.0, help="seconds into the load (default %(default)s)"
    )
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    from examples.models.build import build, missing

    build(args.model_dir, missing(args.model_dir), progress=False)
    with tempfile.TemporaryDirectory(prefix="hardening-supervisor-") as folder:
        launched = launch(args.model_dir, Path(folder) / "pipeline.log", "--replicas", "model=2")
        try:
            figures = asyncio.run(
                kill_under_load(launched, duration=args.duration, kill_at=args.kill_at, clients=args.clients)
            )
        finally:
            code = launched.stop()
        figures["launcher_exit_code"] = code
    if args.json:
        print(json.dumps(figures))
    else:
        print("| clients | seconds | answered | failed | serving again after | taking calls again after |")
        print("|---:|---:|---:|---:|---:|---:|")
        print(
            f"| {figures['clients']} | {figures['seconds']} | {figures['answered']:,} | {figures['failed']:,} "
            f"| {figures['serving_again_s']} s | {figures['taking_calls_again_s']} s |"
        )
        if figures["failed_by_code"]:
            print(f"failed by code: {figures['failed_by_code']}")
    return 0 if figures["failed"] == 0 and figures["taking_calls_again_s"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())

"""Autoscaling and a version rollout under load, on refcnn served by `pipeline run`.

    python -m bench.autoscale [--part scale|rollout|both] [--cooldown S] [--json FILE]

scale: `pipeline run --autoscale model=1:2` with a short cool-down, on the routers' queue (time and depth); 4 closed-loop clients on the refcnn
ensemble, then a step to 32, then back to 4. Prints when the launcher decided to add the second model
replica and when it was listed for the router (seconds after the step), when it removed it after the load
fell (seconds after the fall), the replica count over time, and every request's outcome (no request may
fail).

rollout: `pipeline run --replicas model=2` in explicit model-control mode; 32 clients (16 on the refcnn
ensemble, 16 on refcnn_cnn through the router, whose responses say the version that answered); version 2 of
refcnn_cnn is put in the repository and loaded through the router's RepositoryModelLoad, then the fleet is
rolled back to version 1 by a load pinning it (Triton's `config` parameter). Prints each load's duration, the
window in which both versions answered (from the first answer of the new version to the last of the old),
and the failed requests (none expected).

The example models are built into a folder of their own (refcnn alone), as `bench.compare` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
from google.protobuf import json_format, text_format

from bench.compare import ensemble_variant
from bench.hardening_supervisor import Launched, launch
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.codec import Tensor

#: Each request's deadline, seconds.
DEADLINE = 30.0
#: Launcher log lines of the autoscaler, and what each says.
EVENTS = {
    "up": re.compile(r"autoscaler: model scales up"),
    "listed": re.compile(r"autoscaler: model-\d+ serves on port"),
    "down": re.compile(r"autoscaler: model scales down"),
    "stopped": re.compile(r"autoscaler: model-\d+ stopped"),
}


def image_request(model: str, name: str, dtype: type) -> pb.ModelInferRequest:
    rng = np.random.default_rng(0)
    array = rng.integers(0, 255, (1, 3, 64, 64)).astype(dtype)
    tensor = Tensor.from_array(name, array)
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
    request.raw_input_contents.append(tensor.raw)
    return request


ENSEMBLE = image_request("refcnn", "IMAGE", np.uint8)
MODEL = image_request("refcnn_cnn", "INPUT", np.float32)


class Load:
    """Closed-loop clients that can be added and removed while they run; each outcome counted, and for the
    model's own requests, each answer's time and version."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.outcomes: Counter[str] = Counter()
        self.versions: list[tuple[float, str]] = []
        self.clients: list[tuple[asyncio.Task[None], asyncio.Event]] = []

    def resize(self, count: int, request: Callable[[int], pb.ModelInferRequest]) -> None:
        while len(self.clients) > count:
            _, stop = self.clients.pop()
            stop.set()
        while len(self.clients) < count:
            stop = asyncio.Event()
            task = asyncio.create_task(self._client(request(len(self.clients)), stop))
            self.clients.append((task, stop))

    async def _client(self, request: pb.ModelInferRequest, stop: asyncio.Event) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            while not stop.is_set():
                try:
                    reply = await stub.ModelInfer(request, timeout=DEADLINE)
                except grpc.aio.AioRpcError as err:
                    self.outcomes[f"{err.code().name}: {err.details()}"] += 1
                    continue
                self.outcomes["OK"] += 1
                if request.model_name == "refcnn_cnn":
                    self.versions.append((time.monotonic(), reply.model_version))

    async def close(self) -> None:
        tasks = [task for task, _ in self.clients]
        self.resize(0, lambda i: ENSEMBLE)
        await asyncio.gather(*tasks)


class Events:
    """The autoscaler's lines in the launcher's log, each with the time it was first seen (0.2 s steps)."""

    def __init__(self, launched: Launched) -> None:
        self.launched = launched
        self.seen: dict[str, list[float]] = {name: [] for name in EVENTS}
        self._counted: Counter[str] = Counter()

    def poll(self) -> None:
        text = self.launched.output()
        now = time.monotonic()
        for name, pattern in EVENTS.items():
            found = len(pattern.findall(text))
            while self._counted[name] < found:
                self._counted[name] += 1
                self.seen[name].append(now)

    async def wait(self, name: str, count: int, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while len(self.seen[name]) < count:
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.2)
            self.poll()
        return self.seen[name][count - 1]


async def _watch(events: Events, stop: asyncio.Event) -> None:
    while not stop.is_set():
        events.poll()
        await asyncio.sleep(0.2)


async def scale(folder: Path, cooldown: float, low: int, high: int, before: float, during: float) -> dict:
    launched = launch(
        folder,
        folder.parent / "scale.log",
        "--autoscale",
        "model=1:2",
        "--autoscale-cooldown",
        str(cooldown),
        "--autoscale-interval",
        "1",
        # A closed loop keeps a replica busy at any load: scale on the queue, as the target says.
        "--autoscale-inflight",
        "0",
        "--metrics-port",
        "0",
    )
    events = Events(launched)
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(events, stop))
    load = Load(launched.router)
    try:
        load.resize(low, lambda i: ENSEMBLE)
        await asyncio.sleep(before)
        step = time.monotonic()
        print(f"scale: {low} -> {high} clients", flush=True)
        load.resize(high, lambda i: ENSEMBLE)
        up = await events.wait("up", 1, during)
        listed = await events.wait("listed", 1, max(1.0, step + during - time.monotonic()))
        await asyncio.sleep(max(0.0, step + during - time.monotonic()))
        fall = time.monotonic()
        print(f"scale: {high} -> {low} clients", flush=True)
        load.resize(low, lambda i: ENSEMBLE)
        down = await events.wait("down", 1, cooldown * 3 + 30)
        stopped = await events.wait("stopped", 1, 30)
        await asyncio.sleep(3)
    finally:
        await load.close()
        stop.set()
        await watcher
        launched.stop()
    return {
        "clients": [low, high, low],
        "cooldown_s": cooldown,
        "scaled_up_s_after_step": None if up is None else round(up - step, 1),
        "second_replica_serving_s_after_step": None if listed is None else round(listed - step, 1),
        "scaled_down_s_after_fall": None if down is None else round(down - fall, 1),
        "second_replica_stopped_s_after_fall": None if stopped is None else round(stopped - fall, 1),
        "decisions_s_after_step": {
            name: [round(t - step, 1) for t in times] for name, times in events.seen.items()
        },
        "requests": dict(load.outcomes),
        "failed": sum(n for outcome, n in load.outcomes.items() if outcome != "OK"),
    }


def _pinned_config(folder: Path, version: int) -> str:
    config = text_format.Parse((folder / "refcnn_cnn" / "config.pbtxt").read_text(), mc.ModelConfig())
    config.version_policy.specific.versions[:] = [version]
    return json_format.MessageToJson(config, preserving_proto_field_name=True)


async def _rollout_once(
    stub: pb_grpc.GRPCInferenceServiceStub, load: Load, parameters: dict[str, pb.ModelRepositoryParameter]
) -> dict:
    mark = len(load.versions)
    asked = time.monotonic()
    await stub.RepositoryModelLoad(
        pb.RepositoryModelLoadRequest(model_name="refcnn_cnn", parameters=parameters)
    )
    done = time.monotonic()
    await asyncio.sleep(5)
    seen = load.versions[mark:]
    old = seen[0][1] if seen else ""
    new = seen[-1][1] if seen else ""
    first_new = next((t for t, v in seen if v == new), None)
    last_old = max((t for t, v in seen if v == old), default=None)
    window = 0.0
    if first_new is not None and last_old is not None and last_old > first_new:
        window = last_old - first_new
    return {
        "from": old,
        "to": new,
        "load_s": round(done - asked, 2),
        "mixed_window_ms": round(window * 1000, 1),
        "answers": dict(Counter(v for _, v in seen)),
    }


async def rollout(folder: Path, clients: int, warmup: float) -> dict:
    # Explicit model control on the router and the stages alike (they read the same variable).
    os.environ["PIPELINE_MODEL_CONTROL_MODE"] = "explicit"
    try:
        launched = launch(folder, folder.parent / "rollout.log", "--replicas", "model=2")
    finally:
        del os.environ["PIPELINE_MODEL_CONTROL_MODE"]
    load = Load(launched.router)
    try:
        load.resize(clients, lambda i: MODEL if i % 2 else ENSEMBLE)
        await asyncio.sleep(warmup)
        shutil.copytree(folder / "refcnn_cnn" / "1", folder / "refcnn_cnn" / "2")
        async with grpc.aio.insecure_channel(launched.router) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            forward = await _rollout_once(stub, load, {})
            pinned = {"config": pb.ModelRepositoryParameter(string_param=_pinned_config(folder, 1))}
            back = await _rollout_once(stub, load, pinned)
    finally:
        await load.close()
        launched.stop()
    return {
        "clients": clients,
        "roll_out": forward,
        "roll_back": back,
        "requests": dict(load.outcomes),
        "failed": sum(n for outcome, n in load.outcomes.items() if outcome != "OK"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("scale", "rollout", "both"), default="both")
    parser.add_argument("--cooldown", type=float, default=30.0, help="the autoscaler's cool-down (seconds)")
    parser.add_argument("--before", type=float, default=20.0, help="seconds at the low load before the step")
    parser.add_argument("--during", type=float, default=60.0, help="seconds at the high load")
    parser.add_argument("--low", type=int, default=4)
    parser.add_argument("--high", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-autoscale-") as tmp:
        if args.part in ("scale", "both"):
            folder = Path(tmp) / "scale" / "models"
            folder.mkdir(parents=True)
            ensemble_variant(folder, batching=True)
            results["scale"] = asyncio.run(
                scale(folder, args.cooldown, args.low, args.high, args.before, args.during)
            )
            print(json.dumps({"scale": results["scale"]}, indent=2), flush=True)
        if args.part in ("rollout", "both"):
            folder = Path(tmp) / "rollout" / "models"
            folder.mkdir(parents=True)
            ensemble_variant(folder, batching=True)
            results["rollout"] = asyncio.run(rollout(folder, args.high, args.before))
            print(json.dumps({"rollout": results["rollout"]}, indent=2), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

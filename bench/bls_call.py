"""What one call from inside a model (BLS) costs, beside what one ensemble step costs, in CPU per process.

    python -m bench.bls_call [--duration 4] [--rounds 3] [--concurrency 8] [--calls 4] [--peers DIR]
                             [--out FILE]

Starts `pipeline run` on a repository written for the run: `echo`, a Python model that hands its input back
(on the postprocess service), and two ways to run it `--calls` times in a row for a request:

- `chain_1` and `chain_N`: ensembles of 1 and N `echo` steps;
- `bls_1` and `bls_N`: a Triton Python model (on the preprocess service) whose `async def execute` awaits
  `echo` 1 and N times, one call after the other (`InferenceRequest(...).async_exec()`).

Each is loaded by `--concurrency` clients for `--duration` seconds, `--rounds` times, the models taking
turns, and the CPU each process spends per request is read from /proc. One more step costs (chain_N - chain_1) / (N - 1); one more call costs
(bls_N - bls_1) / (N - 1): the fixed costs (the client's hop, the calling model's own request) cancel out.
Prints a line of JSON per model and the two per-process figures with their ratio.

With `--peers DIR` (the peers' folder, laid out and set up by their install.sh and setup.sh), Triton 2.51
is measured the same way after the pipeline, on the same models written for Triton (`echo` a Python-backend
model, the chains `platform: "ensemble"`, the callers the same `model.py`): its CPU is that of `tritonserver`
and its Python stubs together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.running import Pipeline, cpu_seconds, descendants, per_request, wait_ready
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc

ECHO = """
from pipeline.stage import Stage, TensorSpec


class Echo(Stage):
    inline = True
    inputs = (TensorSpec("INPUT", "FP32", (1, 16)),)
    outputs = (TensorSpec("OUTPUT", "FP32", (1, 16)),)
    max_batch_size = 0

    def infer(self, inputs):
        return {"OUTPUT": inputs["INPUT"]}
"""

CALLER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import json

        self.calls = int(json.loads(args["model_config"])["parameters"]["calls"]["string_value"])

    async def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT")
            for _ in range(self.calls):
                reply = await pb_utils.InferenceRequest(
                    model_name="echo", inputs=[pb_utils.Tensor("INPUT", tensor.as_numpy())],
                    requested_output_names=["OUTPUT"],
                ).async_exec()
                if reply.has_error():
                    raise pb_utils.TritonModelException(reply.error().message())
                tensor = pb_utils.get_output_tensor_by_name(reply, "OUTPUT")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", tensor.as_numpy())]))
        return responses
"""

CALLER_CONFIG = """backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT", data_type: TYPE_FP32, dims: [ 1, 16 ] }} ]
output [ {{ name: "OUTPUT", data_type: TYPE_FP32, dims: [ 1, 16 ] }} ]
instance_group [ {{ count: {count}, kind: KIND_CPU }} ]
parameters {{ key: "calls" value {{ string_value: "{calls}" }} }}
"""


def chain(name: str, steps: int) -> str:
    lines = [
        f"name: {name}",
        "max_batch_size: 0",
        "stages:",
        "  postprocess:",
        "    address: ${POSTPROCESS_ADDRESS:-127.0.0.1:8103}",
        "inputs:",
        "  - {name: INPUT, datatype: FP32, shape: [1, 16]}",
        "outputs:",
        "  - {name: OUTPUT, datatype: FP32, shape: [1, 16]}",
        "steps:",
    ]
    for i in range(steps):
        source = "INPUT" if i == 0 else f"x{i}"
        target = "OUTPUT" if i == steps - 1 else f"x{i + 1}"
        lines += [
            "  - model_name: echo",
            "    stage: postprocess",
            f"    input_map: {{INPUT: {source}}}",
            f"    output_map: {{OUTPUT: {target}}}",
        ]
    return "\n".join(lines) + "\n"


def repository(root: Path, calls: int) -> list[str]:
    """Write the run's models under `root`; the names of those to load, in the order they are measured."""
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text('backend: "python"\n')
    (root / "echo" / "1" / "model.py").write_text(ECHO)
    names = []
    for n in (1, calls):
        for kind in ("chain", "bls"):
            name = f"{kind}_{n}"
            (root / name / "1").mkdir(parents=True) if kind == "bls" else (root / name).mkdir(parents=True)
            if kind == "chain":
                (root / name / "ensemble.yaml").write_text(chain(name, n))
            else:
                (root / name / "config.pbtxt").write_text(CALLER_CONFIG.format(calls=n, count=8))
                (root / name / "1" / "model.py").write_text(CALLER)
            names.append(name)
    return names


#: `echo` for Triton's Python backend.
TRITON_ECHO = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT", pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy())]
            )
            for r in requests
        ]
"""

TENSORS = """input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ 1, 16 ] } ]
output [ { name: "OUTPUT", data_type: TYPE_FP32, dims: [ 1, 16 ] } ]
"""


def triton_repository(root: Path, calls: int) -> None:
    """The same models for Triton: `echo` with two instances, each chain an ensemble of its steps, each
    caller the same `model.py` with two instances (an `async def execute` runs several requests at once)."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "echo" / "1").mkdir(parents=True)
    echo = 'name: "echo"\nbackend: "python"\nmax_batch_size: 0\n' + TENSORS
    (root / "echo" / "config.pbtxt").write_text(echo + "instance_group [ { count: 2, kind: KIND_CPU } ]\n")
    (root / "echo" / "1" / "model.py").write_text(TRITON_ECHO)
    for n in (1, calls):
        (root / f"bls_{n}" / "1").mkdir(parents=True)
        config = f'name: "bls_{n}"\n' + CALLER_CONFIG.format(calls=n, count=2)
        (root / f"bls_{n}" / "config.pbtxt").write_text(config)
        (root / f"bls_{n}" / "1" / "model.py").write_text(CALLER)
        steps = []
        for i in range(n):
            source = "INPUT" if i == 0 else f"x{i}"
            target = "OUTPUT" if i == n - 1 else f"x{i + 1}"
            steps.append(
                f'{{ model_name: "echo" model_version: -1 input_map {{ key: "INPUT" value: "{source}" }} '
                f'output_map {{ key: "OUTPUT" value: "{target}" }} }}'
            )
        (root / f"chain_{n}" / "1").mkdir(parents=True)
        ensemble = f'name: "chain_{n}"\nplatform: "ensemble"\nmax_batch_size: 0\n' + TENSORS
        ensemble += "ensemble_scheduling { step [ " + ", ".join(steps) + " ] }\n"
        (root / f"chain_{n}" / "config.pbtxt").write_text(ensemble)


class Triton:
    """Triton as the peers start it (`triton/serve.sh`: gRPC on 127.0.0.1:8091) on `triton/models`; the CPU
    of its server and its Python stubs."""

    def __init__(self, peers: Path, calls: int) -> None:
        self.folder = peers / "triton"
        triton_repository(self.folder / "models", calls)
        env = {**os.environ, "SERVER_TIMEOUT": "900"}
        subprocess.run(["bash", "serve.sh"], cwd=self.folder, env=env, check=True, timeout=300)
        self.router = "127.0.0.1:8091"
        self.leader = int((self.folder / "server.pid").read_text())

    def cpu(self) -> dict[str, float]:
        return {"triton": sum(cpu_seconds(pid) for pid in descendants(self.leader))}

    def stop(self) -> None:
        stop = self.folder.parent / "common" / "stop_group.sh"
        subprocess.run(["bash", str(stop), str(self.folder / "server.pid")], check=False)


def request(model: str) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model)
    message.inputs.add(name="INPUT", datatype="FP32", shape=[1, 16])
    message.raw_input_contents.append(np.arange(16, dtype=np.float32).tobytes())
    return message


async def load(stub: pb_grpc.GRPCInferenceServiceStub, model: str, concurrency: int, duration: float) -> int:
    """Requests answered by `concurrency` clients sending back to back for `duration` seconds."""
    answered = 0
    stop = time.monotonic() + duration
    expected = np.arange(16, dtype=np.float32).tobytes()

    async def client() -> None:
        nonlocal answered
        message = request(model)
        while time.monotonic() < stop:
            reply = await stub.ModelInfer(message, timeout=30)
            if reply.raw_output_contents[0] != expected:
                raise RuntimeError(f"{model} answered {reply.raw_output_contents[0]!r}")
            answered += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return answered


async def measure(
    server: Pipeline | Triton, names: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Each model loaded `--rounds` times for `--duration` seconds, the models taking turns, so that what
    else the machine does weighs on them alike: requests per second and CPU per request over all rounds."""
    answered = dict.fromkeys(names, 0)
    seconds = dict.fromkeys(names, 0.0)
    spent = {name: dict.fromkeys(server.cpu(), 0.0) for name in names}
    async with grpc.aio.insecure_channel(server.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for name in names:
            await wait_ready(server.router, name)
            await load(stub, name, args.concurrency, 2.0)  # warm up
        for _ in range(args.rounds):
            for name in names:
                before = server.cpu()
                started = time.monotonic()
                answered[name] += await load(stub, name, args.concurrency, args.duration)
                seconds[name] += time.monotonic() - started
                for process, used in server.cpu().items():
                    spent[name][process] += used - before[process]
    results = []
    for name in names:
        cpu = per_request(dict.fromkeys(spent[name], 0.0), spent[name], answered[name])
        results.append(
            {
                "model": name,
                "requests_per_s": answered[name] / seconds[name],
                "cpu_us_per_request": {process: round(us) for process, us in cpu.items()},
            }
        )
    return results


def slopes(results: list[dict[str, Any]], calls: int) -> dict[str, dict[str, float]]:
    """CPU per process of one more ensemble step and of one more BLS call."""
    by = {r["model"]: r["cpu_us_per_request"] for r in results}
    figures: dict[str, dict[str, float]] = {}
    for kind, label in (("chain", "ensemble step"), ("bls", "BLS call")):
        one, many = by[f"{kind}_1"], by[f"{kind}_{calls}"]
        figures[label] = {process: (many[process] - one[process]) / (calls - 1) for process in one}
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bls_call", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=4.0, help="seconds of load per model and round")
    parser.add_argument("--rounds", type=int, default=3, help="turns each model takes")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    parser.add_argument("--calls", type=int, default=4, help="steps and calls per request of the long forms")
    parser.add_argument("--peers", type=Path, default=None, help="the peers' folder: measure Triton too")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON lines here")
    args = parser.parse_args(argv)
    if args.calls < 2:
        parser.error("--calls must be at least 2")
    with tempfile.TemporaryDirectory(prefix="bls-call-bench-") as tmp:
        names = repository(Path(tmp) / "repository", args.calls)
        pipeline = Pipeline(Path(tmp) / "repository", Path(tmp) / "pipeline.log")
        try:
            runs = {"pipeline": asyncio.run(measure(pipeline, names, args))}
        finally:
            pipeline.stop()
    if args.peers is not None:
        triton = Triton(args.peers.resolve(), args.calls)
        try:
            runs["triton"] = asyncio.run(measure(triton, names, args))
        finally:
            triton.stop()
    lines = [
        json.dumps({"server": server, **result}) for server, results in runs.items() for result in results
    ]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    for server, results in runs.items():
        report(server, results, args.calls)


def report(server: str, results: list[dict[str, Any]], calls: int) -> None:
    print(f"\n{server}\n{'model':10} {'req/s':>8}  CPU us per request by process")
    for r in results:
        print(f"{r['model']:10} {r['requests_per_s']:8.1f}  {r['cpu_us_per_request']}")
    figures = slopes(results, calls)
    step, call = figures["ensemble step"], figures["BLS call"]
    print(f"{'CPU us of one more':20} " + " ".join(f"{p:>12}" for p in step))
    for label, row in figures.items():
        print(f"{label:20} " + " ".join(f"{row[p]:12.0f}" for p in step))
    print(f"{server}: BLS call / ensemble step (all processes): {call['all'] / step['all']:.2f}")


if __name__ == "__main__":
    main()

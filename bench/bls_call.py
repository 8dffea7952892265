"""What one call from inside a model (BLS) costs, beside what one ensemble step costs, in CPU per process.

    python -m bench.bls_call [--duration 4] [--rounds 3] [--concurrency 8] [--calls 4] [--elements 8]
                             [--peers DIR] [--out FILE]

Starts `pipeline run` on a repository written for the run, with two Python models on the postprocess
service, `echo` (hands its input back) and `batched_echo` (the same, batched by the router), and two ways to
use each, an ensemble and a Triton Python model on the preprocess service that calls it (BLS):

- in a row: `chain_N` is an ensemble of N `echo` steps, and `bls_N` awaits N `async_exec` calls of `echo`
  one after the other, for N = 1 and `--calls`;
- fanned out: `fan` runs `batched_echo` once per row of its input (a `for_each` step), and `bls_fan` makes
  one `async_exec` call of `batched_echo` per row, all in flight at once; each is sent requests of 1 and
  of `--elements` rows.

Each form is loaded by `--concurrency` clients for `--duration` seconds, `--rounds` times, the forms taking
turns, and the CPU each process spends per request is read from /proc. One more step, call or element costs
the difference between a form's long and short requests divided by the steps, calls or elements added: the
fixed costs (the client's hop, the calling model's own request) cancel out. Prints a line of JSON per form
and the four per-process figures.

With `--peers DIR` (the peers' folder, laid out and set up by their install.sh and setup.sh), Triton 2.51
is measured the same way after the pipeline, on the same models written for Triton (`echo` and
`batched_echo` Python-backend models, the chains `platform: "ensemble"`, the callers the same `model.py`;
Triton has no fan-out step): its CPU is that of `tritonserver` and its Python stubs together.
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
from dataclasses import dataclass
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

#: `echo` (and `batched_echo`) for Triton's Python backend, which the pipeline serves too.
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

BATCHED_ECHO_CONFIG = """name: "batched_echo"
backend: "python"
max_batch_size: 64
input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUTPUT", data_type: TYPE_FP32, dims: [ 16 ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
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

CALLER_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT", data_type: TYPE_FP32, dims: [ 1, 16 ] }} ]
output [ {{ name: "OUTPUT", data_type: TYPE_FP32, dims: [ 1, 16 ] }} ]
instance_group [ {{ count: {count}, kind: KIND_CPU }} ]
parameters {{ key: "calls" value {{ string_value: "{calls}" }} }}
"""

#: One `async_exec` call of `batched_echo` per row of X, all in flight at once.
FAN_CALLER = """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            calls = [
                pb_utils.InferenceRequest(
                    model_name="batched_echo", inputs=[pb_utils.Tensor("INPUT", x[i : i + 1])],
                    requested_output_names=["OUTPUT"],
                ).async_exec()
                for i in range(len(x))
            ]
            rows = []
            for reply in await asyncio.gather(*calls):
                if reply.has_error():
                    raise pb_utils.TritonModelException(reply.error().message())
                rows.append(pb_utils.get_output_tensor_by_name(reply, "OUTPUT").as_numpy())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.concatenate(rows))]))
        return responses
"""

FAN_CALLER_CONFIG = """name: "bls_fan"
backend: "python"
max_batch_size: 0
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ -1, 16 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ -1, 16 ] }} ]
instance_group [ {{ count: {count}, kind: KIND_CPU }} ]
"""

#: The fan-out ensemble: `batched_echo` once per row of X, each row a request of one item at its batcher.
FAN = """name: fan
max_batch_size: 0
stages:
  postprocess:
    address: ${POSTPROCESS_ADDRESS:-127.0.0.1:8103}
inputs:
  - {name: X, datatype: FP32, shape: [-1, 16]}
outputs:
  - {name: Y, datatype: FP32, shape: [-1, 16]}
steps:
  - model_name: batched_echo
    stage: postprocess
    for_each: X
    input_map: {INPUT: X}
    output_map: {OUTPUT: Y}
"""


@dataclass(frozen=True)
class Form:
    """A model sent requests of `rows` rows of its input `tensor`."""

    model: str
    tensor: str
    rows: int = 1

    @property
    def label(self) -> str:
        return self.model if self.tensor == "INPUT" else f"{self.model}@{self.rows}"


#: Each figure: its short and long forms, and how many steps, calls or elements the long one adds.
def figures_of(calls: int, elements: int) -> dict[str, tuple[Form, Form, int]]:
    return {
        "ensemble step": (Form("chain_1", "INPUT"), Form(f"chain_{calls}", "INPUT"), calls - 1),
        "BLS call": (Form("bls_1", "INPUT"), Form(f"bls_{calls}", "INPUT"), calls - 1),
        "fan-out element": (Form("fan", "X", 1), Form("fan", "X", elements), elements - 1),
        "BLS fan-out call": (Form("bls_fan", "X", 1), Form("bls_fan", "X", elements), elements - 1),
    }


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


def _model(root: Path, name: str, config: str, source: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    (root / name / "1" / "model.py").write_text(source)


def repository(root: Path, calls: int) -> None:
    """Write the pipeline's models under `root`."""
    _model(root, "echo", 'backend: "python"\n', ECHO)
    _model(root, "batched_echo", BATCHED_ECHO_CONFIG, TRITON_ECHO)
    _model(root, "bls_fan", FAN_CALLER_CONFIG.format(count=8), FAN_CALLER)
    (root / "fan").mkdir()
    (root / "fan" / "ensemble.yaml").write_text(FAN)
    for n in (1, calls):
        _model(root, f"bls_{n}", CALLER_CONFIG.format(name=f"bls_{n}", calls=n, count=8), CALLER)
        (root / f"chain_{n}").mkdir()
        (root / f"chain_{n}" / "ensemble.yaml").write_text(chain(f"chain_{n}", n))


TENSORS = """input [ { name: "INPUT", data_type: TYPE_FP32, dims: [ 1, 16 ] } ]
output [ { name: "OUTPUT", data_type: TYPE_FP32, dims: [ 1, 16 ] } ]
"""


def triton_repository(root: Path, calls: int) -> None:
    """The same models for Triton: `echo` with two instances, each chain an ensemble of its steps, each
    caller the same `model.py` with two instances (an `async def execute` runs several requests at once)."""
    shutil.rmtree(root, ignore_errors=True)
    echo = 'name: "echo"\nbackend: "python"\nmax_batch_size: 0\n' + TENSORS
    _model(root, "echo", echo + "instance_group [ { count: 2, kind: KIND_CPU } ]\n", TRITON_ECHO)
    _model(root, "batched_echo", BATCHED_ECHO_CONFIG, TRITON_ECHO)
    _model(root, "bls_fan", FAN_CALLER_CONFIG.format(count=2), FAN_CALLER)
    for n in (1, calls):
        _model(root, f"bls_{n}", CALLER_CONFIG.format(name=f"bls_{n}", calls=n, count=2), CALLER)
        steps = []
        for i in range(n):
            source = "INPUT" if i == 0 else f"x{i}"
            target = "OUTPUT" if i == n - 1 else f"x{i + 1}"
            steps.append(
                f'{{ model_name: "echo" model_version: -1 input_map {{ key: "INPUT" value: "{source}" }} '
                f'output_map {{ key: "OUTPUT" value: "{target}" }} }}'
            )
        ensemble = f'name: "chain_{n}"\nplatform: "ensemble"\nmax_batch_size: 0\n' + TENSORS
        ensemble += "ensemble_scheduling { step [ " + ", ".join(steps) + " ] }\n"
        (root / f"chain_{n}" / "1").mkdir(parents=True)
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


def request(form: Form) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=form.model)
    message.inputs.add(name=form.tensor, datatype="FP32", shape=[form.rows, 16])
    message.raw_input_contents.append(np.arange(16 * form.rows, dtype=np.float32).tobytes())
    return message


async def load(stub: pb_grpc.GRPCInferenceServiceStub, form: Form, concurrency: int, duration: float) -> int:
    """Requests answered by `concurrency` clients sending back to back for `duration` seconds."""
    answered = 0
    stop = time.monotonic() + duration
    message = request(form)
    expected = message.raw_input_contents[0]

    async def client() -> None:
        nonlocal answered
        while time.monotonic() < stop:
            reply = await stub.ModelInfer(message, timeout=30)
            if reply.raw_output_contents[0] != expected:
                raise RuntimeError(f"{form.label} answered {reply.raw_output_contents[0]!r}")
            answered += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return answered


async def measure(
    server: Pipeline | Triton, forms: list[Form], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Each form loaded `--rounds` times for `--duration` seconds, the forms taking turns, so that what
    else the machine does weighs on them alike: requests per second and CPU per request over all rounds."""
    answered = dict.fromkeys(forms, 0)
    seconds = dict.fromkeys(forms, 0.0)
    spent = {form: dict.fromkeys(server.cpu(), 0.0) for form in forms}
    async with grpc.aio.insecure_channel(server.router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for form in forms:
            await wait_ready(server.router, form.model)
            await load(stub, form, args.concurrency, 1.0)  # warm up
        for _ in range(args.rounds):
            for form in forms:
                before = server.cpu()
                started = time.monotonic()
                answered[form] += await load(stub, form, args.concurrency, args.duration)
                seconds[form] += time.monotonic() - started
                for process, used in server.cpu().items():
                    spent[form][process] += used - before[process]
    results = []
    for form in forms:
        cpu = per_request(dict.fromkeys(spent[form], 0.0), spent[form], answered[form])
        results.append(
            {
                "form": form.label,
                "requests_per_s": answered[form] / seconds[form],
                "cpu_us_per_request": {process: round(us) for process, us in cpu.items()},
            }
        )
    return results


def slopes(
    results: list[dict[str, Any]], figures: dict[str, tuple[Form, Form, int]]
) -> dict[str, dict[str, float]]:
    """CPU per process of one more of each figure, where both its forms were measured."""
    by = {r["form"]: r["cpu_us_per_request"] for r in results}
    found: dict[str, dict[str, float]] = {}
    for label, (short, long, added) in figures.items():
        if short.label in by and long.label in by:
            one, many = by[short.label], by[long.label]
            found[label] = {process: (many[process] - one[process]) / added for process in one}
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bls_call", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=4.0, help="seconds of load per form and round")
    parser.add_argument("--rounds", type=int, default=3, help="turns each form takes")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    parser.add_argument("--calls", type=int, default=4, help="steps and calls in a row of the long forms")
    parser.add_argument("--elements", type=int, default=8, help="rows of the long fan-out requests")
    parser.add_argument("--peers", type=Path, default=None, help="the peers' folder: measure Triton too")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON lines here")
    args = parser.parse_args(argv)
    if args.calls < 2 or args.elements < 2:
        parser.error("--calls and --elements must be at least 2")
    figures = figures_of(args.calls, args.elements)
    forms = list(dict.fromkeys(form for short, long, _ in figures.values() for form in (short, long)))
    with tempfile.TemporaryDirectory(prefix="bls-call-bench-") as tmp:
        repository(Path(tmp) / "repository", args.calls)
        pipeline = Pipeline(Path(tmp) / "repository", Path(tmp) / "pipeline.log")
        try:
            runs = {"pipeline": asyncio.run(measure(pipeline, forms, args))}
        finally:
            pipeline.stop()
    if args.peers is not None:
        triton = Triton(args.peers.resolve(), args.calls)
        try:
            runs["triton"] = asyncio.run(measure(triton, [f for f in forms if f.model != "fan"], args))
        finally:
            triton.stop()
    lines = [
        json.dumps({"server": server, **result}) for server, results in runs.items() for result in results
    ]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    for server, results in runs.items():
        report(server, results, slopes(results, figures))


def report(server: str, results: list[dict[str, Any]], figures: dict[str, dict[str, float]]) -> None:
    print(f"\n{server}\n{'form':12} {'req/s':>8}  CPU us per request by process")
    for r in results:
        print(f"{r['form']:12} {r['requests_per_s']:8.1f}  {r['cpu_us_per_request']}")
    processes = list(next(iter(figures.values())))
    print(f"{'CPU us of one more':20} " + " ".join(f"{p:>12}" for p in processes))
    for label, row in figures.items():
        print(f"{label:20} " + " ".join(f"{row[p]:12.0f}" for p in processes))
    for call, step in (("BLS call", "ensemble step"), ("BLS fan-out call", "fan-out element")):
        if call in figures and step in figures:
            ratio = figures[call]["all"] / figures[step]["all"]
            print(f"{server}: {call} / {step} (all processes): {ratio:.2f}")


if __name__ == "__main__":
    main()

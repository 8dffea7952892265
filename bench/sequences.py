"""Sequence batching figures: concurrent sequences of a stateful model on two replicas behind router workers.

    python -m bench.sequences [--model-dir DIR] [--sequences 32] [--requests 100] [--kill]

Starts two model services serving `textgen_state` (the textgen GRU as a stateful model: the server keeps each
sequence's hidden state) and a router with two workers in front of them, as processes on ports the OS picks,
then sends SEQUENCES concurrent sequences of REQUESTS requests each (one chunk of text per request, the next
request of a sequence sent when the last is answered; several channels, so both router workers take them).
It prints:

- whether every sequence's outputs equal a single-process reference run of the same network (the likeliest
  next character exactly, the probabilities within 1e-4);
- requests/s and latency percentiles;
- the model's mean batch on each replica (its own ModelStatistics), and each replica's share of the
  sequences, against the replica that rendezvous hashing ranks first for each sequence (so a sequence split
  across replicas would show, besides being refused by the replica it strayed to);
- with `--kill`, a second run in which one replica is SIGKILLed once 30% of the requests are answered: which
  sequences failed, with what, and whether they are exactly those the killed replica held.

The example models must be built (`make model`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from bench.scaling import start, wait_ready
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import Tensor, response_tensors
from pipeline.protocol.sequences import SequenceId, sequence_key, set_sequence
from pipeline.router.stages.replicas import rendezvous
from pipeline.router.stages.targets import Target

MODEL = "textgen_state"
CORPUS = Path(__file__).resolve().parent.parent / "examples" / "models" / "textgen_corpus.txt"
NEWLINE = 10


def chunks(sequence: int, count: int) -> list[bytes]:
    """A sequence's text, `count` chunks of 1 to 8 characters read on from a place of the corpus its number
    picks (spaces and letters only, as the network was trained on)."""
    text = CORPUS.read_bytes().replace(b"\n", b" ")
    rng = np.random.default_rng(sequence)
    at = int(rng.integers(0, len(text) // 2))
    out = []
    for size in rng.integers(1, 9, size=count):
        if at + size > len(text):
            at = 0
        out.append(text[at : at + int(size)])
        at += int(size)
    return out


def reference(path: Path, texts: list[bytes]) -> list[tuple[bytes, np.ndarray]]:
    """The network run in this process on one sequence's chunks, one at a time from its own state."""
    import torch

    network = torch.jit.load(str(path)).eval()
    state = network.initial_state(1)
    out = []
    with torch.inference_mode():
        for i, text in enumerate(texts):
            ids = ([NEWLINE] if i == 0 else []) + list(text)
            logits, state = network(torch.tensor([ids]), state)
            probabilities = torch.softmax(logits[0, -1], dim=-1).numpy()
            out.append((bytes([int(probabilities.argmax())]), probabilities))
    return out


@dataclass
class Outcome:
    """One sequence's run: its answers, their latencies, and the error that ended it (if any)."""

    answers: list[tuple[bytes, np.ndarray]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    error: tuple[str, str] | None = None


def request(sequence: int, step: int, last: int, text: bytes) -> pb.ModelInferRequest:
    tensor = Tensor.from_array("TEXT", np.array([[text]], dtype=object))
    message = pb.ModelInferRequest(model_name=MODEL)
    message.inputs.add(name="TEXT", datatype=tensor.datatype, shape=tensor.shape)
    message.raw_input_contents.append(tensor.raw)
    set_sequence(message, SequenceId(sequence, step == 0, step == last))
    return message


async def run_sequences(
    router: str, ids: list[int], texts: dict[int, list[bytes]], answered: list[int]
) -> dict[int, Outcome]:
    """Every sequence at once, each request after the last one's answer; a sequence stops at its first
    error. `answered` counts the answers as they come (another task may act on it)."""
    channels = [
        grpc.aio.insecure_channel(router, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(8)
    ]
    outcomes = {sequence: Outcome() for sequence in ids}

    async def one(index: int, sequence: int) -> None:
        stub = pb_grpc.GRPCInferenceServiceStub(channels[index % len(channels)])
        own = texts[sequence]
        outcome = outcomes[sequence]
        for step, text in enumerate(own):
            started = time.perf_counter()
            try:
                reply = await stub.ModelInfer(request(sequence, step, len(own) - 1, text), timeout=60)
            except grpc.aio.AioRpcError as err:
                outcome.error = (err.code().name, err.details() or "")
                return
            outcome.latencies.append(time.perf_counter() - started)
            outputs = response_tensors(reply)
            outcome.answers.append(
                (bytes(outputs["NEXT"].to_array().reshape(-1)[0]), outputs["PROBS"].to_array()[0])
            )
            answered[0] += 1

    try:
        await asyncio.gather(*(one(i, sequence) for i, sequence in enumerate(ids)))
    finally:
        for channel in channels:
            await channel.close()
    return outcomes


def replica_statistics(address: str) -> tuple[int, int, int, int]:
    """(inferences, executions, queue ns, compute ns) of the model on one replica (the times summed over its
    requests)."""
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            pb.ModelStatisticsRequest(name=MODEL), timeout=10
        )
    stats = reply.model_stats[0]
    durations = stats.inference_stats
    return stats.inference_count, stats.execution_count, durations.queue.ns, durations.compute_infer.ns


def wait_model(address: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=2).ready:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{MODEL} not ready at {address}")


def matches(outcome: Outcome, expected: list[tuple[bytes, np.ndarray]]) -> bool:
    return all(
        got[0] == want[0] and np.allclose(got[1], want[1], atol=1e-4)
        for got, want in zip(outcome.answers, expected, strict=False)
    )


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@dataclass
class Fleet:
    """The two model replicas (process, address) and the router in front of them, as started."""

    replicas: list[tuple[subprocess.Popen[bytes], str]]
    router: str
    #: The replicas as the router's target lists them, and each one's address.
    fixed: tuple[str, ...]
    by_fixed: dict[str, str]

    def home(self, sequence: int) -> str:
        """The replica that rendezvous hashing ranks first for a sequence: the one that should hold it."""
        return self.by_fixed[rendezvous(self.fixed, sequence_key(SequenceId(sequence, False, False)))[0]]


def start_fleet(
    model_dir: Path, workers: int, folder: Path, processes: list[subprocess.Popen[bytes]]
) -> Fleet:
    """Two model services serving the model and a router with `workers` workers in front of them, each
    process added to `processes` as it starts; returns once the model is ready through the router."""
    replicas = []
    for i in range(2):
        command = ["-m", "services.model", "--model-dir", str(model_dir), "--load-model", MODEL]
        process, address = start(f"model-{i}", command, folder)
        processes.append(process)
        replicas.append((process, address))
    for _, address in replicas:
        wait_model(address)
    target = "ipv4:" + ",".join(address for _, address in replicas)
    router_command = ["-m", "pipeline", "router", "--workers", str(workers), "--stage", f"model={target}"]
    router, router_address = start("router", router_command, folder)
    processes.append(router)
    wait_ready(router_address)
    wait_model(router_address)
    fixed = Target.parse(target).fixed
    by_fixed = dict(zip(fixed, (address for _, address in replicas), strict=True))
    return Fleet(replicas, router_address, fixed, by_fixed)


def measure_run(fleet: Fleet, network: Path, args: argparse.Namespace) -> dict:
    """Every sequence to its end: whether the answers equal the reference, the rates and latencies, and
    each replica's share against the sequences ranked to it."""
    ids = list(range(1, args.sequences + 1))
    texts = {sequence: chunks(sequence, args.requests) for sequence in ids}
    expected = {sequence: reference(network, texts[sequence]) for sequence in ids}
    before = {address: replica_statistics(address) for _, address in fleet.replicas}
    started = time.perf_counter()
    outcomes = asyncio.run(run_sequences(fleet.router, ids, texts, [0]))
    elapsed = time.perf_counter() - started
    after = {address: replica_statistics(address) for _, address in fleet.replicas}
    latencies = [x for o in outcomes.values() for x in o.latencies]
    failed = {s: o.error for s, o in outcomes.items() if o.error}
    equal = all(matches(o, expected[s]) and len(o.answers) == args.requests for s, o in outcomes.items())
    report = {
        "sequences": args.sequences,
        "requests_per_sequence": args.requests,
        "router_workers": args.workers,
        "failed": len(failed),
        "outputs_equal_reference": equal,
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(percentile(latencies, 50) * 1e3, 2),
        "p99_ms": round(percentile(latencies, 99) * 1e3, 2),
        "replicas": {},
    }
    total_inferences = total_executions = 0
    for _, address in fleet.replicas:
        inferences = after[address][0] - before[address][0]
        executions = after[address][1] - before[address][1]
        queue_ns = after[address][2] - before[address][2]
        compute_ns = after[address][3] - before[address][3]
        total_inferences += inferences
        total_executions += executions
        ranked_here = sum(1 for s in ids if fleet.home(s) == address)
        report["replicas"][address] = {
            "inferences": inferences,
            "mean_batch": round(inferences / executions, 2) if executions else None,
            "queue_ms_per_request": round(queue_ns / inferences / 1e6, 2) if inferences else None,
            "compute_ms_per_request": round(compute_ns / inferences / 1e6, 2) if inferences else None,
            "sequences_ranked_here": ranked_here,
            "inferences_expected": ranked_here * args.requests,
        }
    report["mean_batch"] = round(total_inferences / total_executions, 2) if total_executions else None
    report["no_sequence_split"] = all(
        r["inferences"] == r["inferences_expected"] for r in report["replicas"].values()
    )
    return report


def measure_kill(fleet: Fleet, network: Path, args: argparse.Namespace) -> dict:
    """The same load again, one replica SIGKILLed once 30% of the requests are answered: which sequences
    failed, with what, and whether they are exactly those the killed replica held."""
    ids = list(range(10_001, 10_001 + args.sequences))
    texts = {sequence: chunks(sequence, args.requests) for sequence in ids}
    expected = {sequence: reference(network, texts[sequence]) for sequence in ids}
    victim, victim_address = fleet.replicas[0]
    answered = [0]

    async def kill_when_due() -> None:
        while answered[0] < 0.3 * args.sequences * args.requests:
            await asyncio.sleep(0.005)
        victim.send_signal(signal.SIGKILL)

    async def both() -> dict[int, Outcome]:
        killer = asyncio.create_task(kill_when_due())
        outcomes = await run_sequences(fleet.router, ids, texts, answered)
        killer.cancel()
        return outcomes

    outcomes = asyncio.run(both())
    victim.wait(10)
    held = {s for s in ids if fleet.home(s) == victim_address}
    failed = {s: o.error for s, o in outcomes.items() if o.error}
    clear = all(
        code == "UNAVAILABLE" and f"sequence {s} of model '{MODEL}' is lost" in message
        for s, (code, message) in failed.items()
    )
    others_equal = all(
        matches(o, expected[s]) and len(o.answers) == args.requests
        for s, o in outcomes.items()
        if s not in held
    )
    lost_answers_equal = all(matches(outcomes[s], expected[s]) for s in held)
    return {
        "killed_after_answers": int(0.3 * args.sequences * args.requests),
        "sequences_on_killed_replica": len(held),
        "failed_sequences": len(failed),
        "failed_are_exactly_the_killed_replicas": set(failed) == held,
        "every_failure_unavailable_naming_its_sequence": clear,
        "other_sequences_complete_and_equal_reference": others_equal,
        "answers_before_the_kill_equal_reference": lost_answers_equal,
        "example_error": next(iter(failed.values()), None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sequences", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=os.environ.get("PIPELINE_MODEL_DIR", "model_repository"))
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kill", action="store_true", help="also run with one replica SIGKILLed mid-run")
    args = parser.parse_args()
    model_dir = Path(args.model_dir).resolve()
    network = model_dir / MODEL / "1" / "model.pt"
    if not network.is_file():
        print(f"{network} is missing: build the example models first (make model)", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="bench-sequences-"))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        fleet = start_fleet(model_dir, args.workers, folder, processes)
        print(json.dumps({"run": measure_run(fleet, network, args)}, indent=2))
        if args.kill:
            print(json.dumps({"kill": measure_kill(fleet, network, args)}, indent=2))
        return 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    sys.exit(main())

"""Scaling figures: a stage at 1 vs 2 replicas, a pair with one slow replica, router workers 1 vs 2.

    python -m bench.scaling RESULTS_DIR [--duration S] [--variants NAME,...]

Each variant starts the stage services and the router as processes on ports the OS picks (the layout of
`pipeline run --replicas model=N`; the model stage is `bench.model_stage`), drives them with `pipeline bench`, and prints one line:
throughput, p50/p99, the model's mean batch size as the router saw it, each model replica's share of the
calls (from its own ModelStatistics), and the load average when it ran. The slow replica is the model
stage with 20 ms added to every call (`bench.model_stage --delay-ms 20`). Figures land in RESULTS_DIR/<variant>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc

SENTENCE = "The quick brown fox jumps over the lazy dog while the router batches every sentence it sees."


@dataclass
class Variant:
    ensemble: str
    model_replicas: int = 1
    slow: int = 0  # how many of the model replicas answer 20 ms late
    workers: int = 1
    connections: int = 1
    inputs: list[str] = field(default_factory=list)


VARIANTS = {
    "embeddings-model1": Variant("embeddings"),
    "embeddings-model2": Variant("embeddings", model_replicas=2),
    "embeddings-model2-slow": Variant("embeddings", model_replicas=2, slow=1),
    "refcnn-workers1": Variant("refcnn", connections=8),
    "refcnn-workers2": Variant("refcnn", workers=2, connections=8),
}


def start(name: str, command: list[str], folder: Path, env: dict[str, str] | None = None) -> tuple:
    port_file = folder / f"{name}.port"
    log = open(folder / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
    process = subprocess.Popen(
        [sys.executable, *command, "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)],
        env={**os.environ, **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    while not port_file.exists():
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited: see {folder / (name + '.log')}")
        time.sleep(0.05)
    return process, f"127.0.0.1:{int(port_file.read_text())}"


def wait_ready(address: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.ServerReady(pb.ServerReadyRequest(), timeout=2).ready:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not ready")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def executions(address: str, model: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            pb.ModelStatisticsRequest(name=model), timeout=10
        )
    return reply.model_stats[0].execution_count


def run(name: str, variant: Variant, results: Path, duration: float) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"scaling-{name}-"))
    processes = []
    try:
        off = ["--metrics-port", "off"]
        pre, pre_address = start("preprocess", ["-m", "services.preprocess", *off], folder)
        post, post_address = start("postprocess", ["-m", "services.postprocess", *off], folder)
        processes += [pre, post]
        models = []
        for i in range(variant.model_replicas):
            delay = ["--delay-ms", "20"] if i < variant.slow else []
            process, address = start(f"model-{i}", ["-m", "bench.model_stage", *delay, *off], folder)
            processes.append(process)
            models.append(address)
        env = {
            "PREPROCESS_ADDRESS": pre_address,
            "MODEL_ADDRESS": models[0] if len(models) == 1 else "ipv4:" + ",".join(models),
            "POSTPROCESS_ADDRESS": post_address,
        }
        router_command = ["-m", "pipeline", "router", "--ensembles", f"ensembles/{variant.ensemble}.yaml"]
        router_command += ["--workers", str(variant.workers), "--http-port", "off", "--metrics-port", "off"]
        router, router_address = start("router", router_command, folder, env)
        processes.insert(0, router)
        for address in [*models, router_address]:
            wait_ready(address)
        model_name = {"embeddings": "minilm_encoder", "refcnn": "refcnn_cnn"}[variant.ensemble]
        before = [executions(a, model_name) for a in models]
        sentence = folder / "sentence.txt"
        sentence.write_text(SENTENCE)
        inputs = ["--input-file", f"TEXT={sentence}"] if variant.ensemble == "embeddings" else []
        load = os.getloadavg()
        out = results / f"{name}.json"
        named = {"router": router, "preprocess": pre, "postprocess": post}
        named.update({f"model-{i}": p for i, p in enumerate(processes[3:])})
        cpu_before, wall_before = {n: cpu_seconds(p.pid) for n, p in named.items()}, time.monotonic()
        subprocess.run(
            [
                *(sys.executable, "-m", "pipeline", "bench", "--url", router_address),
                *("--model", variant.ensemble, "--concurrency", "32", "--duration", str(duration)),
                *("--warmup", "5", "--connections", str(variant.connections), "--json", str(out)),
                "--no-progress",
                *inputs,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wall = time.monotonic() - wall_before
        # Cores each process used while the load ran (a router with workers: its parent only).
        cores = {n: round((cpu_seconds(p.pid) - cpu_before[n]) / wall, 2) for n, p in named.items()}
        calls = [executions(a, model_name) - b for a, b in zip(models, before, strict=True)]
        level = json.loads(out.read_text())["results"][0]
        stage = level["stages"].get(model_name, {})
        figure = {
            "variant": name,
            "infer_per_s": round(level["throughput_infer_per_s"], 1),
            "p50_ms": round(level["latency_ms"]["p50"], 1),
            "p99_ms": round(level["latency_ms"]["p99"], 1),
            "errors": level["errors"],
            "mean_batch": stage.get("mean_batch_size"),
            "replica_calls": calls,
            "cores": cores,
            "loadavg_before": [round(x, 2) for x in load],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        }
        print(json.dumps(figure), flush=True)
        return figure
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    for name in args.variants.split(","):
        run(name, VARIANTS[name], args.results, args.duration)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

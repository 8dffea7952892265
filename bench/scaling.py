"""Scaling figures: a stage at 1 vs 2 replicas, a pair with one slow replica, router workers 1 vs 2.

    python -m bench.scaling RESULTS_DIR [--duration S] [--variants NAME,...]

Each variant starts the three services on the model repository and the router as processes on ports the OS
picks (the layout of `pipeline run --replicas model=N`), drives them with `pipeline bench`, and prints one
line: throughput, p50/p99, the model's mean batch size as the router saw it, each model replica's share of
the calls (from its own ModelStatistics), the cores each process used and the load average when it ran. The
slow replica is the model service with 20 ms added to every execution (`bench.model_stage --delay-ms 20`).
Figures land in RESULTS_DIR/<variant>.json. The example models must be built (`make model`).

    python -m bench.scaling RESULTS_DIR --compose [--variants embeddings-model1,embeddings-model2]

runs the variants with Docker Compose instead: `docker compose up -d --scale model=N` from this checkout
(images built, `docker compose build`; Compose v2 or docker-compose v1), the load generator in a container
of the router's image on the stages' network (`compose run`). Cores are read per container (its processes
on the host); `machine` is everything the machine was busy with, the engine's work included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
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


VARIANTS = {
    "embeddings-model1": Variant("embeddings"),
    "embeddings-model2": Variant("embeddings", model_replicas=2),
    "embeddings-model2-slow": Variant("embeddings", model_replicas=2, slow=1),
    "refcnn-workers1": Variant("refcnn", connections=8),
    "refcnn-workers2": Variant("refcnn", workers=2, connections=8),
}


#: Figures compared within each round: name -> (variant, baseline variant).
RATIOS = {
    "model x2 / x1": ("embeddings-model2", "embeddings-model1"),
    "slow pair / healthy pair": ("embeddings-model2-slow", "embeddings-model2"),
    "router workers 2 / 1": ("refcnn-workers2", "refcnn-workers1"),
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
    """CPU time (user + system) a process and its children (a router's workers) have used, from /proc
    (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError):  # exited meanwhile
                total += cpu_seconds(int(child))
    return total


def machine_seconds() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy (every process, the kernel, interrupts) and those the
    hypervisor took for other guests (steal), from /proc/stat (Linux)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


class CoreMeter:
    """The cores used from its making to `cores()`: by each process of `pids` (a router with workers: all of
    them), with `client` by this process's children (the load generator, on the same cores), and by the whole
    machine."""

    def __init__(self, pids: dict[str, int], *, client: bool) -> None:
        self.pids = pids
        self.client = resource.getrusage(resource.RUSAGE_CHILDREN) if client else None
        self.cpu = {n: cpu_seconds(pid) for n, pid in pids.items()}
        self.machine = machine_seconds()
        self.wall = time.monotonic()

    def cores(self) -> dict[str, float]:
        wall = time.monotonic() - self.wall
        cores = {n: round((cpu_seconds(pid) - self.cpu[n]) / wall, 2) for n, pid in self.pids.items()}
        if self.client is not None:
            client, before = resource.getrusage(resource.RUSAGE_CHILDREN), self.client
            used = client.ru_utime + client.ru_stime - before.ru_utime - before.ru_stime
            cores["client"] = round(used / wall, 2)
        busy, steal = (
            round((after - before) / wall, 2)
            for after, before in zip(machine_seconds(), self.machine, strict=True)
        )
        cores["machine"] = busy  # everything, the engine's and the kernel's work included
        cores["stolen"] = steal  # taken by the hypervisor for other guests
        return cores


def executions(address: str, model: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            pb.ModelStatisticsRequest(name=model), timeout=10
        )
    return reply.model_stats[0].execution_count


def measure(
    name: str,
    variant: Variant,
    router_address: str,
    pids: dict[str, int],
    model_addresses: list[str],
    folder: Path,
    results: Path,
    duration: float,
    container: list[str] | None = None,
) -> dict:
    """Drive a started pipeline at concurrency 32 and return (and print) its figures. `model_addresses`:
    the model replicas whose ModelStatistics can be read from here (empty: none can). `container`: run the
    load generator with this command prefix (a container that mounts `folder` at /bench) instead of here."""
    model_name = {"embeddings": "minilm_encoder", "refcnn": "refcnn_cnn"}[variant.ensemble]
    before = [executions(a, model_name) for a in model_addresses]
    sentence = folder / "sentence.txt"
    sentence.write_text(SENTENCE)
    seen = Path("/bench") if container else folder  # the folder as the load generator sees it
    inputs = ["--input-file", f"TEXT={seen / sentence.name}"] if variant.ensemble == "embeddings" else []
    load = os.getloadavg()
    out = folder / "bench.json"
    generator = [*container, "pipeline"] if container else [sys.executable, "-m", "pipeline"]
    meter = CoreMeter(pids, client=not container)  # a container's processes are not this one's children
    subprocess.run(
        [
            *(*generator, "bench", "--url", router_address),
            *("--model", variant.ensemble, "--concurrency", "32", "--duration", str(duration)),
            *("--warmup", "5", "--connections", str(variant.connections), "--json", str(seen / out.name)),
            "--no-progress",
            *inputs,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    cores = meter.cores()
    shutil.copyfile(out, results / f"{name}.json")
    calls = [executions(a, model_name) - b for a, b in zip(model_addresses, before, strict=True)]
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


def run(
    name: str, variant: Variant, results: Path, duration: float, model_dir: Path, ensembles: Path | None
) -> dict:
    """One variant as processes on this machine."""
    folder = Path(tempfile.mkdtemp(prefix=f"scaling-{name}-"))
    processes = []
    try:
        off = ["--metrics-port", "off"]
        stage = [*off, "--model-dir", str(model_dir)]
        pre, pre_address = start("preprocess", ["-m", "services.preprocess", *stage], folder)
        post, post_address = start("postprocess", ["-m", "services.postprocess", *stage], folder)
        processes += [pre, post]
        models = []
        for i in range(variant.model_replicas):
            entry = (
                ["-m", "bench.model_stage", "--delay-ms", "20"]
                if i < variant.slow
                else ["-m", "services.model"]
            )
            process, address = start(f"model-{i}", [*entry, *stage], folder)
            processes.append(process)
            models.append(address)
        env = {
            "PREPROCESS_ADDRESS": pre_address,
            "MODEL_ADDRESS": models[0] if len(models) == 1 else "ipv4:" + ",".join(models),
            "POSTPROCESS_ADDRESS": post_address,
        }
        router_command = ["-m", "pipeline", "router"]
        # The variant's ensemble alone (no --model-dir, which would add the repository's every ensemble):
        # a file of `--ensembles`, else the repository's own.
        ensemble = (
            ensembles / f"{variant.ensemble}.yaml"
            if ensembles is not None
            else model_dir / variant.ensemble / "ensemble.yaml"
        )
        router_command += ["--ensembles", str(ensemble)]
        router_command += ["--workers", str(variant.workers), "--http-port", "off", *off]
        router, router_address = start("router", router_command, folder, env)
        processes.insert(0, router)
        for address in [*models, router_address]:
            wait_ready(address)
        pids = {"router": router.pid, "preprocess": pre.pid, "postprocess": post.pid}
        pids.update({f"model-{i}": p.pid for i, p in enumerate(processes[3:])})
        return measure(name, variant, router_address, pids, models, folder, results, duration)
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def compose_command() -> list[str]:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    return ["docker", "compose"] if probe.returncode == 0 else ["docker-compose"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_compose(name: str, variant: Variant, results: Path, duration: float) -> dict:
    """One variant with Docker Compose: `up -d --scale model=N`, driven from a container on the stages'
    network, then `down`."""
    if variant.slow or variant.workers != 1:
        raise SystemExit(f"{name}: only the replica variants run with --compose")
    compose = compose_command()
    port = free_port()
    env = {
        **os.environ,
        "COMPOSE_PROJECT_NAME": "pipelinebench",
        "PIPELINE_ROUTER_PUBLISHED_PORT": str(port),
        "PIPELINE_HTTP_PUBLISHED_PORT": str(free_port()),
        "PIPELINE_RESOLVE_INTERVAL_S": "2",  # the warm-up (5 s) outlasts it: every replica is in use
    }
    folder = Path(tempfile.mkdtemp(prefix=f"scaling-{name}-"))
    try:
        up = subprocess.run(
            [*compose, "up", "-d", "--scale", f"model={variant.model_replicas}"],
            env=env,
            capture_output=True,
            text=True,
        )
        if up.returncode != 0:
            raise RuntimeError(f"compose up failed: {up.stderr[-2000:]}")
        containers = wait_healthy(compose, env, count=3 + variant.model_replicas)
        wait_ready(f"127.0.0.1:{port}", timeout=180)
        # The load generator runs in a container of the router's image on the stages' network, as a client
        # elsewhere would call the router: not through the engine's proxy for the published port, which
        # would take a share of the same two cores.
        folder.chmod(0o777)  # the container's user writes its report there
        runner = [*compose, "-p", env["COMPOSE_PROJECT_NAME"], "run", "--rm", "--no-deps", "-T"]
        runner += ["-v", f"{folder}:/bench", "router"]
        router = f"router:{env.get('PIPELINE_ROUTER_PORT', '8001')}"  # compose.yaml's port inside the network
        return measure(name, variant, router, containers, [], folder, results, duration, runner)
    finally:
        subprocess.run(
            [*compose, "down", "-v"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )


#: A container's name, state, health ("none" without a health check) and host pid.
INSPECT_STATE = "{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.State.Pid}}"


def wait_healthy(compose: list[str], env: dict[str, str], count: int, timeout: float = 180) -> dict[str, int]:
    """Wait until `count` containers of the project are healthy; returns their names and host pids."""
    deadline = time.monotonic() + timeout
    while True:
        ids = subprocess.run([*compose, "ps", "-q"], env=env, capture_output=True, text=True).stdout.split()
        states = {}
        for container in ids:
            name, status, health, pid = subprocess.run(
                ["docker", "inspect", "-f", INSPECT_STATE, container],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            if status != "exited":  # the one-shot model-repository service, once it has written the volume
                states[name.strip("/")] = (health, int(pid))
        if len(states) >= count and all(health == "healthy" for health, _ in states.values()):
            return {name: pid for name, (_, pid) in sorted(states.items())}
        if time.monotonic() > deadline:
            raise TimeoutError(f"containers not healthy within {timeout:.0f} s: {states}")
        time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--model-dir", type=Path, default=Path("model_repository"))
    parser.add_argument(
        "--ensembles",
        type=Path,
        default=None,
        help="a folder of <ensemble>.yaml files to serve instead of the repository's <ensemble>/ensemble.yaml",
    )
    parser.add_argument(
        "--compose",
        action="store_true",
        help="run the replica variants with Docker Compose (`up --scale model=N`) instead of processes",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the variants this many times, interleaved (the machine's speed drifts between runs: "
        "compare the variants of one round)",
    )
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    names = args.variants.split(",")
    rounds: list[dict[str, float]] = []
    for round_ in range(args.repeat):
        figures = {}
        for name in names:
            tag = name if args.repeat == 1 else f"{name}-r{round_ + 1}"
            if args.compose:
                figure = run_compose(tag, VARIANTS[name], args.results, args.duration)
            else:
                figure = run(tag, VARIANTS[name], args.results, args.duration, args.model_dir, args.ensembles)
            figures[name] = figure["infer_per_s"]
        rounds.append(figures)
    for ratio, (top, bottom) in RATIOS.items():
        if top in names and bottom in names:
            values = sorted(r[top] / r[bottom] for r in rounds)
            print(
                f"{ratio}: "
                + ", ".join(f"{v:.2f}" for v in values)
                + f" (median {statistics.median(values):.2f})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The peers of `../shared/peers` (laid out by its install.sh, set up by its setup.sh), run one at a time on
this machine beside the pipeline: their load generator, their in-process baseline, TorchServe and Triton.

Every figure comes from the peers' own closed-loop load generator (`loadgen/loadgen.py`), which loads any
OIP endpoint the same way: one server at a time, each level after the machine has quietened."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.running import cpu_seconds, descendants

#: The concurrency levels every system is measured at.
LEVELS = (1, 8, 32)
#: Triton's two configurations in the peers' run: a 5 ms queue delay on every step, and none.
TRITON_DELAYS = (5000, 0)


def loadgen(
    peers: Path,
    mode: str,
    url: str,
    label: str,
    out: Path,
    warmup: float,
    duration: float,
    concurrency: int,
    *extra: str,
    quiet_wait: float = 30.0,
) -> dict[str, Any]:
    """The peers' load generator against `url` at one concurrency: throughput, p50_ms, p99_ms, errors. It first
    waits up to `quiet_wait` seconds for the machine's other load to fall under 0.15 of a core."""
    command = [str(peers / "loadgen" / "venv" / "bin" / "python"), str(peers / "loadgen" / "loadgen.py")]
    command += ["--mode", mode, "--url", url, "--concurrency", str(concurrency), "--label", label]
    command += [
        "--json-out",
        str(out),
        "--warmup",
        str(warmup),
        "--duration",
        str(duration),
        "--quiet-wait",
        str(quiet_wait),
    ]
    subprocess.run([*command, *extra], check=True, timeout=warmup + duration + 120)
    (row,) = json.loads(out.read_text())
    return row


def tree_cpu(pidfile: Path) -> float:
    """CPU seconds (user and system) the server started with `pidfile` and every process under it have spent
    so far: Triton's core and its Python-backend stubs, TorchServe's frontend and its workers."""
    total = 0.0
    for pid in descendants(int(pidfile.read_text().split()[0])):
        with contextlib.suppress(OSError):  # a process that ended between the listing and the reading
            total += cpu_seconds(pid)
    return total


def measured(
    pidfile: Path, run: Callable[[], dict[str, Any]], warmup: float, duration: float
) -> dict[str, Any]:
    """`run`'s row with the CPU microseconds each request cost the server's processes, all together, counted
    as the pipeline's are (`bench.compare.peers_levels`): over warm-up and measurement, per request answered in
    that time."""
    before = tree_cpu(pidfile)
    row = run()
    answered = row["throughput"] * (warmup + duration)
    row["cpu_us_per_request"] = {"all": (tree_cpu(pidfile) - before) / answered * 1e6 if answered else None}
    print(f"   cpu µs/request {row['cpu_us_per_request']}", flush=True)
    return row


def oip_level(
    peers: Path,
    url: str,
    label: str,
    out: Path,
    warmup: float,
    duration: float,
    concurrency: int,
    pidfile: Path,
    quiet_wait: float = 30.0,
) -> dict[str, Any]:
    """`loadgen` over OIP gRPC (refcnn: IMAGE in, LABEL out) at one concurrency, against the server started
    with `pidfile`, with the CPU each request cost it."""
    oip = ("--model", "refcnn", "--input-name", "IMAGE", "--output-name", "LABEL")
    oip += ("--server-pidfile", str(pidfile))
    run = functools.partial(
        loadgen, peers, "v2grpc", url, label, out, warmup, duration, concurrency, *oip, quiet_wait=quiet_wait
    )
    return measured(pidfile, run, warmup, duration)


def oip_levels(
    peers: Path, url: str, label: str, out: Path, warmup: float, duration: float, pidfile: Path
) -> list[dict[str, Any]]:
    """`oip_level` at every level of `LEVELS`."""
    return [
        oip_level(peers, url, label, out.with_suffix(f".c{c}.json"), warmup, duration, c, pidfile)
        for c in LEVELS
    ]


def baseline(peers: Path, out: Path) -> list[dict[str, Any]]:
    """The peers' in-process baseline with one torch thread: images/s at batches of 1, 8 and 32."""
    python = peers / "baseline" / "venv" / "bin" / "python"
    subprocess.run(
        [str(python), str(peers / "baseline" / "bench.py"), "1", str(out)], check=True, timeout=300
    )
    return json.loads(out.read_text())


def _stop(peers: Path, pidfile: Path) -> None:
    subprocess.run(["bash", str(peers / "common" / "stop_group.sh"), str(pidfile)], check=False)


@contextlib.contextmanager
def torchserve_serving(peers: Path) -> Iterator[Path]:
    """TorchServe up as the peers run it (batch 32, 5 ms, one worker, one torch thread) for the time of the
    block: its pidfile. The archive is made the first time."""
    folder = peers / "torchserve"
    (folder / "model_store").mkdir(exist_ok=True)
    if not (folder / "model_store" / "refcnn.mar").exists():
        archiver = folder / "venv" / "bin" / "torch-model-archiver"
        extra = str(peers / "common" / "refmodel.py")
        archive = [
            "--model-name",
            "refcnn",
            "--version",
            "1.0",
            "--handler",
            "handler.py",
            "--extra-files",
            extra,
        ]
        subprocess.run(
            [str(archiver), *archive, "--export-path", "model_store", "--force"], cwd=folder, check=True
        )
    env = {**os.environ, "REF_TORCH_THREADS": "1", "SERVER_TIMEOUT": "1800"}
    subprocess.run(["bash", "serve.sh"], cwd=folder, env=env, check=True, timeout=180)
    try:
        yield folder / "server.pid"
    finally:
        _stop(peers, folder / "server.pid")


def torchserve_level(
    peers: Path,
    pidfile: Path,
    out: Path,
    warmup: float,
    duration: float,
    concurrency: int,
    quiet_wait: float = 30.0,
) -> dict[str, Any]:
    """The load generator on TorchServe's HTTP API at one concurrency, with the CPU each request cost it."""
    url = "http://127.0.0.1:8085/predictions/refcnn"
    run = functools.partial(
        loadgen,
        peers,
        "http",
        url,
        "torchserve http",
        out,
        warmup,
        duration,
        concurrency,
        "--server-pidfile",
        str(pidfile),
        quiet_wait=quiet_wait,
    )
    return measured(pidfile, run, warmup, duration)


def torchserve(peers: Path, out: Path, warmup: float, duration: float) -> list[dict[str, Any]]:
    """TorchServe at every level of `LEVELS`, over HTTP."""
    with torchserve_serving(peers) as pidfile:
        return [
            torchserve_level(peers, pidfile, out.with_suffix(f".c{c}.json"), warmup, duration, c)
            for c in LEVELS
        ]


#: Triton's gRPC address as the peers' serve.sh starts it.
TRITON_URL = "127.0.0.1:8091"


@contextlib.contextmanager
def triton_serving(peers: Path, delay: int) -> Iterator[Path]:
    """Triton 2.51 up for the time of the block, serving the peers' refcnn ensemble of three Python-backend
    steps with `delay` as every step's max_queue_delay_microseconds: its pidfile."""
    folder = peers / "triton"
    models = folder / "models"
    subprocess.run(["rm", "-rf", str(models)], check=True)
    subprocess.run(["cp", "-r", str(folder / "repository"), str(models)], check=True)
    for config in models.glob("*/config.pbtxt"):
        text = config.read_text()
        config.write_text(
            re.sub(r"max_queue_delay_microseconds: \d+", f"max_queue_delay_microseconds: {delay}", text)
        )
    env = {**os.environ, "REF_TORCH_THREADS": "1", "SERVER_TIMEOUT": "1800"}
    subprocess.run(["bash", "serve.sh"], cwd=folder, env=env, check=True, timeout=300)
    try:
        yield folder / "server.pid"
    finally:
        _stop(peers, folder / "server.pid")


def triton(peers: Path, out: Path, warmup: float, duration: float) -> dict[int, list[dict[str, Any]]]:
    """Triton 2.51 in each of `TRITON_DELAYS` at every level of `LEVELS`; gRPC on `TRITON_URL`."""
    results: dict[int, list[dict[str, Any]]] = {}
    for delay in TRITON_DELAYS:
        with triton_serving(peers, delay) as pidfile:
            label = f"triton ensemble delay={delay}us"
            results[delay] = oip_levels(
                peers, TRITON_URL, label, out.with_suffix(f".d{delay}.json"), warmup, duration, pidfile
            )
    return results

"""The peers of `../shared/peers` (laid out by its install.sh, set up by its setup.sh), run one at a time on
this machine beside the pipeline: their load generator, their in-process baseline, TorchServe and Triton.

Every figure comes from the peers' own closed-loop load generator (`loadgen/loadgen.py`), which loads any
OIP endpoint the same way: one server at a time, each level after the machine has quietened."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

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
) -> dict[str, Any]:
    """The peers' load generator against `url` at one concurrency: throughput, p50_ms, p99_ms, errors."""
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
        "30",
    ]
    subprocess.run([*command, *extra], check=True, timeout=warmup + duration + 120)
    (row,) = json.loads(out.read_text())
    return row


def oip_levels(
    peers: Path, url: str, label: str, out: Path, warmup: float, duration: float, *extra: str
) -> list[dict[str, Any]]:
    """`loadgen` over OIP gRPC (refcnn: IMAGE in, LABEL out) at every level of `LEVELS`."""
    oip = ("--model", "refcnn", "--input-name", "IMAGE", "--output-name", "LABEL", *extra)
    return [
        loadgen(peers, "v2grpc", url, label, out.with_suffix(f".c{c}.json"), warmup, duration, c, *oip)
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


def torchserve(peers: Path, out: Path, warmup: float, duration: float) -> list[dict[str, Any]]:
    """TorchServe as the peers run it (batch 32, 5 ms, one worker, one torch thread), over HTTP."""
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
    env = {**os.environ, "REF_TORCH_THREADS": "1", "SERVER_TIMEOUT": "900"}
    subprocess.run(["bash", "serve.sh"], cwd=folder, env=env, check=True, timeout=180)
    url = "http://127.0.0.1:8085/predictions/refcnn"
    pid = ("--server-pidfile", str(folder / "server.pid"))
    try:
        return [
            loadgen(
                peers,
                "http",
                url,
                "torchserve http",
                out.with_suffix(f".c{c}.json"),
                warmup,
                duration,
                c,
                *pid,
            )
            for c in LEVELS
        ]
    finally:
        _stop(peers, folder / "server.pid")


def triton(peers: Path, out: Path, warmup: float, duration: float) -> dict[int, list[dict[str, Any]]]:
    """Triton 2.51 serving the peers' refcnn ensemble of three Python-backend steps, in each of
    `TRITON_DELAYS` (every step's max_queue_delay_microseconds); gRPC on 127.0.0.1:8091."""
    folder = peers / "triton"
    results: dict[int, list[dict[str, Any]]] = {}
    for delay in TRITON_DELAYS:
        models = folder / "models"
        subprocess.run(["rm", "-rf", str(models)], check=True)
        subprocess.run(["cp", "-r", str(folder / "repository"), str(models)], check=True)
        for config in models.glob("*/config.pbtxt"):
            text = config.read_text()
            config.write_text(
                re.sub(r"max_queue_delay_microseconds: \d+", f"max_queue_delay_microseconds: {delay}", text)
            )
        env = {**os.environ, "REF_TORCH_THREADS": "1", "SERVER_TIMEOUT": "900"}
        subprocess.run(["bash", "serve.sh"], cwd=folder, env=env, check=True, timeout=300)
        try:
            pid = ("--server-pidfile", str(folder / "server.pid"))
            label = f"triton ensemble delay={delay}us"
            results[delay] = oip_levels(
                peers, "127.0.0.1:8091", label, out.with_suffix(f".d{delay}.json"), warmup, duration, *pid
            )
        finally:
            _stop(peers, folder / "server.pid")
    return results

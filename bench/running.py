"""The pipeline as `pipeline run` starts it, for the benchmarks: its addresses and processes, the CPU each
process spent, and the batches its router formed (ModelStatistics), read around a measured interval."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
_SERVING = re.compile(r"pipeline: serving .* on (\S+) \(gRPC")
_HTTP = re.compile(r" and (http\S+) \(HTTP/REST\)")
_STAGE = re.compile(r"(\w+) (\S+:\d+) \(pid \d+\)")
_METRICS = re.compile(r"pipeline: Prometheus metrics: (.*)")
_METRIC_URL = re.compile(r"([\w-]+) (http://\S+/metrics)")
#: Process names by what their command line runs.
_KINDS = (("pipeline router", "router"), ("services.preprocess", "preprocess"), ("services.model", "model"))
_KINDS += (("services.postprocess", "postprocess"), ("pipeline-front", "front"))


class Pipeline:
    """`pipeline run` on ports the OS picks, its output in a log file; the router's and stages' addresses,
    their metrics endpoints and their process ids."""

    def __init__(
        self,
        model_dir: Path | Sequence[str],
        log: Path,
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 240.0,
    ) -> None:
        """`pipeline run --model-dir model_dir`: the repository decides what is served (or, where `model_dir`
        is a list of flags, they do: e.g. `--model-store DIR`)."""
        self.log = log
        served = ["--model-dir", str(model_dir)] if isinstance(model_dir, Path) else list(model_dir)
        command = [sys.executable, "-m", "pipeline", "run", *served, "--port", "0"]
        for flag in (
            "--preprocess-port",
            "--model-port",
            "--postprocess-port",
            "--http-port",
            "--metrics-port",
        ):
            command += [flag, "0"]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        deadline = time.monotonic() + timeout
        while True:
            text = log.read_text(errors="replace")
            found = _SERVING.search(text)
            if found:
                self.router = found.group(1)
                line = text[found.start() :].splitlines()[0]
                http = _HTTP.search(line)
                self.http = http.group(1) if http else None
                self.stages = dict(_STAGE.findall(line.split("stages:", 1)[1]))
                while (metrics := _METRICS.search(log.read_text(errors="replace"))) is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError("`pipeline run` printed no metrics addresses")
                    time.sleep(0.1)
                self.metrics = dict(_METRIC_URL.findall(metrics.group(1)))
                self.pids = _processes(self.process.pid)
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(text.strip().splitlines()[-5:])
                raise RuntimeError(f"`pipeline run` did not start (see {log.name}):\n{tail}")
            time.sleep(0.2)

    def cpu(self) -> dict[str, float]:
        """CPU seconds each process has spent so far (user and system)."""
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # the launcher drains the router, then the stages
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> list[int]:
    """`root` and every process under it, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, pending = [], [root]
    while pending:
        pid = pending.pop(0)
        found.append(pid)
        pending += children.get(pid, [])
    return found


def _processes(root: int) -> dict[str, int]:
    """The router and stage processes under the launcher `root`, by kind."""
    found: dict[str, int] = {}
    for pid in descendants(root)[1:]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        for marker, kind in _KINDS:
            if marker in command and kind not in found:
                found[kind] = pid
    return found


async def _statistics(url: str, model: str) -> pb.ModelStatistics:
    async with grpc.aio.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10)
        return reply.model_stats[0]


def statistics(url: str, model: str) -> pb.ModelStatistics:
    """A model's ModelStatistics as the router at `url` reports it."""
    return asyncio.run(_statistics(url, model))


def mean_batch(before: pb.ModelStatistics, after: pb.ModelStatistics) -> float | None:
    """Items per execution between two readings."""
    executions = after.execution_count - before.execution_count
    return (after.inference_count - before.inference_count) / executions if executions else None


async def wait_ready(url: str, model: str, timeout: float = 180.0) -> None:
    """Wait until `model` is ready at `url` (stages load their models one after another)."""
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while not (await stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=5)).ready:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{model} not ready at {url} within {timeout:.0f}s")
            await asyncio.sleep(0.2)


def per_request(cpu_before: dict[str, float], cpu_after: dict[str, float], requests: float) -> dict[str, Any]:
    """CPU microseconds per request in each process, and in all of them together."""
    spent = {name: (cpu_after[name] - cpu_before[name]) / requests * 1e6 for name in cpu_after}
    return {**spent, "all": sum(spent.values())}

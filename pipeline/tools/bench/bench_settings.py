"""`pipeline bench`'s settings: the server and the model it loads, the load, how its client runs and where
its results go, each a flag (the server's also a `PIPELINE_*` variable: `client_settings.Client`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel

from pipeline.runtime.client_settings import Client
from pipeline.runtime.settings_cli import option, process_settings
from pipeline.tools.bench.endpoints import PROTOCOLS
from pipeline.tools.bench.options import ARRIVALS


def _numbers(kind: type) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


class BenchTarget(BaseModel):
    """The protocol and the model to load (the server is `Client`'s)."""

    protocol: Annotated[
        str,
        option(
            "--protocol",
            choices=PROTOCOLS,
            help="the protocol's gRPC side, or its HTTP/REST side with binary tensor data (default grpc)",
        ),
    ] = "grpc"
    model: Annotated[str, option("--model", "-m", help="model or ensemble name")]
    model_version: Annotated[
        str, option("--model-version", help="version (default: the server's default)")
    ] = ""


class Workload(BaseModel):
    """What the load is: its levels, their timing, the requests' inputs."""

    concurrency: Annotated[
        list[int],
        option(
            "--concurrency",
            parse=_numbers(int),
            exclusive="load",
            help="closed loop: comma-separated numbers of concurrent workers (default 1)",
        ),
    ] = [1]
    rate: Annotated[
        list[float],
        option(
            "--rate",
            parse=_numbers(float),
            exclusive="load",
            help="open loop: comma-separated arrival rates (requests/s)",
        ),
    ] = []
    arrival: Annotated[str, option("--arrival", choices=ARRIVALS, help="open-loop arrivals")] = "poisson"
    warmup: Annotated[float, option("--warmup", parse=float, help="seconds before measuring each level")] = (
        2.0
    )
    duration: Annotated[float, option("--duration", parse=float, help="measured seconds per level")] = 10.0
    batch: Annotated[
        int, option("--batch", "-b", parse=int, help="items per request (the batch dimension)")
    ] = 1
    shape: Annotated[
        list[str],
        option("--shape", action="append", metavar="NAME=d1,d2", help="fix an input's variable dims"),
    ] = []
    input_file: Annotated[
        list[str],
        option(
            "--input-file",
            action="append",
            metavar="NAME=PATH",
            help="an input's data: a .npy file is the whole tensor; any other file is one BYTES element. Given "
            "several times for one input, requests send the files in turn (a mixed workload: repeat a file to "
            "weigh it)",
        ),
    ] = []
    value: Annotated[
        list[str],
        option(
            "--value",
            action="append",
            metavar="NAME=VALUE",
            help="an input holding one value throughout: a number, or text for BYTES (e.g. MAX_TOKENS=64)",
        ),
    ] = []
    stream: Annotated[
        bool,
        option(
            "--stream",
            action="store_true",
            help="send each request over a ModelStreamInfer stream of its own and time its responses (a "
            "decoupled model's many): time to the first response and the gaps between responses, besides "
            "responses/s and streams/s (gRPC only)",
        ),
    ] = False
    repeat_share: Annotated[
        float | None,
        option(
            "--repeat-share",
            parse=float,
            metavar="S",
            help="a workload for a response cache: this share (0..1) of the requests repeats one same input, "
            "the others send inputs never sent before (synthesised inputs only)",
        ),
    ] = None


class LoadClient(BaseModel):
    """How the load client runs: deadlines, processes, connections, limits, and the servers' CPU it reads."""

    timeout: Annotated[
        float, option("--timeout", parse=float, help="deadline of each request, in seconds")
    ] = 30.0
    processes: Annotated[
        int, option("--processes", parse=int, help="load processes (when one cannot keep up)")
    ] = 1
    connections: Annotated[
        int,
        option(
            "--connections",
            parse=int,
            help="gRPC connections per load process, calls spread over them in turn (a router with --workers "
            "spreads connections over its processes, not calls)",
        ),
    ] = 1
    max_inflight: Annotated[
        int,
        option("--max-inflight", parse=int, help="open loop: most outstanding requests (then drop)"),
    ] = 10_000
    max_message_mb: Annotated[int, option("--max-message-mb", parse=int, help="largest message, in MiB")] = 64
    seed: Annotated[int, option("--seed", parse=int, help="seed of the random inputs and arrivals")] = 0
    cpu: Annotated[
        list[str],
        option(
            "--cpu",
            action="append",
            metavar="NAME=URL",
            help="a server process's Prometheus /metrics URL (repeatable; `pipeline run` prints them): its "
            "process_cpu_seconds_total is read around each measured interval, giving CPU microseconds per "
            "request",
        ),
    ] = []


class BenchOutput(BaseModel):
    """Where the results go besides the tables printed."""

    json_file: Annotated[
        Path | None,
        option("--json", parse=Path, metavar="JSON", help="write the results as JSON to this file"),
    ] = None
    plot: Annotated[
        Path | None,
        option("--plot", parse=Path, help="write throughput and p99 latency against load as a PNG"),
    ] = None
    progress: Annotated[bool, option("--no-progress", action="store_false", help="no progress bar")] = True


#: `pipeline bench`'s settings, in the order `--help` lists them: the server (`Client`) and the model, the load,
#: its client, its output.
BenchSettings = process_settings("BenchSettings", (Client, BenchTarget, Workload, LoadClient, BenchOutput))

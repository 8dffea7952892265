"""The `pipeline bench` command line: its flags, the options they make, and the command itself."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import uvloop

from pipeline.runtime.client_settings import ClientSettings
from pipeline.runtime.settings_cli import add_arguments
from pipeline.tools.bench.endpoints import PROTOCOLS
from pipeline.tools.bench.options import ARRIVALS, BenchError, BenchOptions
from pipeline.tools.bench.report import format_report, write_json, write_plot
from pipeline.tools.bench.run import run_bench


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """`NAME=d1,d2` → (NAME, (d1, d2))."""
    name, sep, dims = text.partition("=")
    try:
        shape = tuple(int(d) for d in dims.split(",") if d.strip())
    except ValueError:
        shape = ()
    if not sep or not name or not shape or any(d < 0 for d in shape):
        raise BenchError(f"--shape expects NAME=d1,d2,... with dims >= 0, got {text!r}")
    return name, shape


def _numbers(kind: type) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pipeline bench`."""
    _add_endpoint_arguments(parser)
    _add_workload_arguments(parser)
    _add_client_arguments(parser)
    _add_output_arguments(parser)


def _add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The server and the model to load."""
    add_arguments(parser, ClientSettings)
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="grpc",
        help="the protocol's gRPC side, or its HTTP/REST side with binary tensor data (default grpc)",
    )
    parser.add_argument("--model", "-m", required=True, help="model or ensemble name")
    parser.add_argument("--model-version", default="", help="version (default: the server's default)")


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """What the load is: its levels, their timing, the requests' inputs."""
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=_numbers(int),
        default=[1],
        help="closed loop: comma-separated numbers of concurrent workers (default 1)",
    )
    load.add_argument(
        "--rate",
        type=_numbers(float),
        default=[],
        help="open loop: comma-separated arrival rates (requests/s)",
    )
    parser.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="open-loop arrivals")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring each level")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    parser.add_argument("--batch", "-b", type=int, default=1, help="items per request (the batch dimension)")
    parser.add_argument(
        "--shape", action="append", default=[], metavar="NAME=d1,d2", help="fix an input's variable dims"
    )
    parser.add_argument(
        "--input-file",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="an input's data: a .npy file is the whole tensor; any other file is one BYTES element. Given "
        "several times for one input, requests send the files in turn (a mixed workload: repeat a file to "
        "weigh it)",
    )
    parser.add_argument(
        "--value",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an input holding one value throughout: a number, or text for BYTES (e.g. MAX_TOKENS=64)",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="send each request over a ModelStreamInfer stream of its own and time its responses (a "
        "decoupled model's many): time to the first response and the gaps between responses, besides "
        "responses/s and streams/s (gRPC only)",
    )
    parser.add_argument(
        "--repeat-share",
        type=float,
        default=None,
        metavar="S",
        help="a workload for a response cache: this share (0..1) of the requests repeats one same input, the "
        "others send inputs never sent before (synthesised inputs only)",
    )


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """How the load client runs: deadlines, processes, connections, limits, the servers' CPU it reads and
    the token it carries."""
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of each request, in seconds")
    parser.add_argument("--processes", type=int, default=1, help="load processes (when one cannot keep up)")
    parser.add_argument(
        "--connections",
        type=int,
        default=1,
        help="gRPC connections per load process, calls spread over them in turn (a router with --workers "
        "spreads connections over its processes, not calls)",
    )
    parser.add_argument(
        "--max-inflight", type=int, default=10_000, help="open loop: most outstanding requests (then drop)"
    )
    parser.add_argument("--max-message-mb", type=int, default=64, help="largest message, in MiB")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs and arrivals")
    parser.add_argument(
        "--cpu",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a server process's Prometheus /metrics URL (repeatable; `pipeline run` prints them): its "
        "process_cpu_seconds_total is read around each measured interval, giving CPU microseconds per request",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the results go besides the tables printed."""
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--plot", type=Path, help="write throughput and p99 latency against load as a PNG")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """`BenchOptions` from parsed `pipeline bench` flags."""
    files: dict[str, list[Path]] = {}
    for item in args.input_file:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise BenchError(f"--input-file expects NAME=PATH, got {item!r}")
        files.setdefault(name, []).append(Path(path))
    values = {}
    for item in args.value:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise BenchError(f"--value expects NAME=VALUE, got {item!r}")
        values[name] = text
    cpu = {}
    for item in args.cpu:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise BenchError(f"--cpu expects NAME=URL, got {item!r}")
        cpu[name] = url if "://" in url else f"http://{url}/metrics"
    return BenchOptions(
        url=args.url,
        model=args.model,
        model_version=args.model_version,
        protocol=args.protocol,
        concurrency=args.concurrency,
        rates=args.rate,
        arrival=args.arrival,
        warmup=args.warmup,
        duration=args.duration,
        batch=args.batch,
        shapes=dict(parse_shape(s) for s in args.shape),
        values=values,
        input_files=files,
        repeat_share=args.repeat_share,
        timeout=args.timeout,
        processes=args.processes,
        connections=args.connections,
        max_inflight=args.max_inflight,
        max_message_mb=args.max_message_mb,
        seed=args.seed,
        progress=args.progress,
        cpu_metrics=cpu,
        token=args.token,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        stream=args.stream,
    )


def run_bench_command(args: argparse.Namespace) -> int:
    """`pipeline bench`: measure, print the tables, write the JSON and the plot; returns the exit code."""
    try:
        options = options_from_args(args)
        report = uvloop.run(run_bench(options))
        print(format_report(report), flush=True)
        if args.json:
            write_json(report, args.json)
        if args.plot:
            write_plot(report, args.plot)
    except BenchError as err:
        print(f"pipeline bench: {err}", file=sys.stderr)
        return 2
    return 0

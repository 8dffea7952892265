"""The `pipeline bench` command: the options its settings (`pipeline.tools.bench.bench_settings`) make, and
the command itself."""

from __future__ import annotations

import sys
from pathlib import Path

import uvloop

from pipeline.runtime.client_settings import Client
from pipeline.runtime.settings_cli import ProcessSettings
from pipeline.tools.bench.bench_settings import BenchOutput, BenchTarget, LoadClient, Workload
from pipeline.tools.bench.options import BenchError, BenchOptions
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


def options_of(settings: ProcessSettings) -> BenchOptions:
    """`BenchOptions` from `pipeline bench`'s settings."""
    server, target, load = settings.group(Client), settings.group(BenchTarget), settings.group(Workload)
    client, output = settings.group(LoadClient), settings.group(BenchOutput)
    files: dict[str, list[Path]] = {}
    for item in load.input_file:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise BenchError(f"--input-file expects NAME=PATH, got {item!r}")
        files.setdefault(name, []).append(Path(path))
    values = {}
    for item in load.value:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise BenchError(f"--value expects NAME=VALUE, got {item!r}")
        values[name] = text
    cpu = {}
    for item in client.cpu:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise BenchError(f"--cpu expects NAME=URL, got {item!r}")
        cpu[name] = url if "://" in url else f"http://{url}/metrics"
    return BenchOptions(
        url=server.url,
        model=target.model,
        model_version=target.model_version,
        protocol=target.protocol,
        concurrency=load.concurrency,
        rates=load.rate,
        arrival=load.arrival,
        warmup=load.warmup,
        duration=load.duration,
        batch=load.batch,
        shapes=dict(parse_shape(s) for s in load.shape),
        values=values,
        input_files=files,
        repeat_share=load.repeat_share,
        timeout=client.timeout,
        processes=client.processes,
        connections=client.connections,
        max_inflight=client.max_inflight,
        max_message_mb=client.max_message_mb,
        seed=client.seed,
        progress=output.progress,
        cpu_metrics=cpu,
        token=server.token,
        tls_ca=server.tls_ca,
        tls_cert=server.tls_cert,
        tls_key=server.tls_key,
        stream=load.stream,
    )


def run_bench_command(settings: ProcessSettings) -> int:
    """`pipeline bench`: measure, print the tables, write the JSON and the plot; returns the exit code."""
    output = settings.group(BenchOutput)
    try:
        options = options_of(settings)
        report = uvloop.run(run_bench(options))
        print(format_report(report), flush=True)
        if output.json_file:
            write_json(report, output.json_file)
        if output.plot:
            write_plot(report, output.plot)
    except BenchError as err:
        print(f"pipeline bench: {err}", file=sys.stderr)
        return 2
    return 0

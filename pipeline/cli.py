"""The `pipeline` command: run the whole pipeline, run the router alone, send a request, benchmark, or
look at a trace."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from pipeline.runtime import settings


def _infer(args: argparse.Namespace) -> int:
    import grpc

    from pipeline.tools.client import InferenceClient, bytes_batch

    client = InferenceClient(
        args.url, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key, token=args.token
    )
    with client:
        try:
            meta = client.model_metadata(args.model, timeout=args.timeout)
            inputs = {}
            for item in args.input:
                name, _, path = item.partition("=")
                inputs[name] = np.load(path, allow_pickle=False)
            if args.files:
                byte_inputs = [t for t in meta.inputs if t.datatype == "BYTES"]
                if len(byte_inputs) != 1:
                    print(
                        f"model '{args.model}' has no single BYTES input to send files to; use --input NAME=file.npy",
                        file=sys.stderr,
                    )
                    return 2
                target = byte_inputs[0]
                inputs[target.name] = bytes_batch([Path(f).read_bytes() for f in args.files], target.shape)
            outputs = client.infer(args.model, inputs, timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"{err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({name: array.tolist() for name, array in outputs.items()}))
        return 0
    count = next(iter(outputs.values())).shape[0] if outputs else 0
    names = args.files or [f"item {i}" for i in range(count)]
    for i, label in enumerate(names[:count]):
        fields = []
        for name, array in outputs.items():
            row = array[i].reshape(-1)
            if row.size == 1:
                fields.append(f"{name}={row[0]}")
            else:
                values = np.array2string(
                    row, precision=3, suppress_small=True, separator=" ", max_line_width=10**6
                )
                fields.append(f"{name}={values}")
        print(f"{label}: {'  '.join(fields)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipeline", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    from pipeline.router.main import add_router_arguments, run_router
    from pipeline.tools.launcher import add_run_arguments, run

    run_parser = commands.add_parser("run", help="start the stage services and the router as local processes")
    add_run_arguments(run_parser)
    run_parser.set_defaults(func=run)

    router_parser = commands.add_parser("router", help="serve the ensembles (stages run elsewhere)")
    add_router_arguments(router_parser)
    router_parser.set_defaults(func=run_router)

    infer = commands.add_parser("infer", help="send one request to a model or ensemble and print the outputs")
    infer.add_argument("files", nargs="*", help="files sent as the model's BYTES input, one batch item each")
    infer.add_argument("--model", "-m", required=True, help="ensemble or model name, e.g. digits")
    infer.add_argument(
        "--url",
        "-u",
        default=settings.URL.get(),
        help="host:port of the router",
    )
    infer.add_argument(
        "--input", "-i", action="append", default=[], metavar="NAME=FILE.npy", help="a numeric input"
    )
    infer.add_argument("--timeout", type=float, default=30.0, help="deadline in seconds")
    infer.add_argument("--json", action="store_true", help="print the outputs as JSON")
    from pipeline.runtime.security import add_client_tls_arguments

    add_client_tls_arguments(infer, prefix="", env_prefix="PIPELINE_CLIENT_")
    infer.add_argument(
        "--token",
        default=settings.TOKEN.get(),
        help="bearer token for a router that asks for one (env PIPELINE_TOKEN)",
    )
    infer.set_defaults(func=_infer)

    from pipeline.tools.bench.cli import add_bench_arguments, run_bench_command

    bench = commands.add_parser("bench", help="load a model or ensemble and report throughput and latency")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench_command)

    from pipeline.tools.trace_view import add_trace_arguments, run_trace_command

    trace = commands.add_parser(
        "trace", help="print a request's trace from a JSON-lines span file as a waterfall"
    )
    add_trace_arguments(trace)
    trace.set_defaults(func=run_trace_command)

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

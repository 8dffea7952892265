"""The `pipeline` command: run the whole pipeline, run the router alone, send a request, benchmark, or
look at a trace."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The `pipeline` command line, each subcommand's flags with their defaults from the environment
    (`pipeline.runtime.settings`); the reference in docs/reference/ is generated from it (`pipeline.docgen`)."""
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

    from pipeline.tools.infer import add_infer_arguments, run_infer_command

    infer = commands.add_parser(
        "infer",
        help="send one request to a model or ensemble and print the outputs (--stream: every response)",
    )
    add_infer_arguments(infer)
    infer.set_defaults(func=run_infer_command)

    from pipeline.tools.bench.command import add_bench_arguments, run_bench_command

    bench = commands.add_parser("bench", help="load a model or ensemble and report throughput and latency")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench_command)

    from pipeline.tools.trace_view import add_trace_arguments, run_trace_command

    trace = commands.add_parser(
        "trace", help="print a request's trace from a JSON-lines span file as a waterfall"
    )
    add_trace_arguments(trace)
    trace.set_defaults(func=run_trace_command)

    from services.model.quantize import add_quantize_arguments, run_quantize_command

    quantize = commands.add_parser(
        "quantize",
        help="write an INT8 version of an ONNX or PyTorch model beside it, and report its accuracy and speed "
        "against FP32",
    )
    add_quantize_arguments(quantize)
    quantize.set_defaults(func=run_quantize_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["router"]:
        from pipeline.runtime.allocator import keep_freed_memory

        keep_freed_memory()  # before the imports that start threads (`pipeline.runtime.allocator`)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

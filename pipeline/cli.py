"""The `pipeline` command: run the whole pipeline, run the router alone, send a request, benchmark, or
look at a trace."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.runtime.settings_cli import ProcessSettings, SettingError, add_arguments


@dataclass(frozen=True)
class Subcommand:
    """One `pipeline` subcommand: what it does, its settings model (its flags) and what runs it with the
    settings its command line gives."""

    help: str
    settings: type[ProcessSettings]
    run: Callable[[ProcessSettings], int]


def subcommands() -> dict[str, Subcommand]:
    """Every `pipeline` subcommand, by its name, in the order `--help` lists them."""
    from pipeline.router.main import run_router
    from pipeline.runtime.router_settings import RouterSettings
    from pipeline.tools.bench.bench_settings import BenchSettings
    from pipeline.tools.bench.command import run_bench_command
    from pipeline.tools.infer import InferSettings, run_infer_command
    from pipeline.tools.launcher import run
    from pipeline.tools.launcher_settings import LauncherSettings
    from pipeline.tools.trace_view import TraceSettings, run_trace_command
    from services.model.quantize import QuantizeCommand, run_quantize_command

    return {
        "run": Subcommand(
            "start the stage services and the router as local processes", LauncherSettings, run
        ),
        "router": Subcommand("serve the ensembles (stages run elsewhere)", RouterSettings, run_router),
        "infer": Subcommand(
            "send one request to a model or ensemble and print the outputs (--stream: every response)",
            InferSettings,
            run_infer_command,
        ),
        "bench": Subcommand(
            "load a model or ensemble and report throughput and latency", BenchSettings, run_bench_command
        ),
        "trace": Subcommand(
            "print a request's trace from a JSON-lines span file as a waterfall",
            TraceSettings,
            run_trace_command,
        ),
        "quantize": Subcommand(
            "write an INT8 version of an ONNX or PyTorch model beside it, and report its accuracy and speed "
            "against FP32",
            QuantizeCommand,
            run_quantize_command,
        ),
    }


def build_parser() -> argparse.ArgumentParser:
    """The `pipeline` command line, each subcommand's flags from its settings model, with their defaults from
    the environment (`pipeline.runtime.settings_cli.add_arguments`); the reference in docs/reference/ is
    generated from it (`pipeline.docgen`)."""
    parser = argparse.ArgumentParser(prog="pipeline", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, subcommand in subcommands().items():
        command = commands.add_parser(name, help=subcommand.help)
        add_arguments(command, subcommand.settings)
        command.set_defaults(subcommand=subcommand, parser=command)
    return parser


def parse(argv: Sequence[str] | None = None) -> tuple[Subcommand, ProcessSettings]:
    """The subcommand a command line names, and the settings it gives (parsed once, into the subcommand's
    model); a value the settings refuse stops with a usage error that names it."""
    args = build_parser().parse_args(argv)
    subcommand: Subcommand = args.subcommand
    parser: argparse.ArgumentParser = args.parser
    try:
        return subcommand, subcommand.settings.of(args)
    except SettingError as err:
        parser.error(str(err))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the subcommand the command line names, with its settings."""
    if (sys.argv[1:] if argv is None else list(argv))[:1] == ["router"]:
        from pipeline.runtime.allocator import keep_freed_memory

        keep_freed_memory()  # before the imports that start threads (`pipeline.runtime.allocator`)
    subcommand, settings = parse(argv)
    return int(subcommand.run(settings) or 0)


if __name__ == "__main__":
    sys.exit(main())

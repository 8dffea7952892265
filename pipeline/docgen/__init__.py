"""Generate the reference pages of the documentation, docs/reference/, from what they describe: every
`pipeline` subcommand, every service's entry point, their flags, and every environment variable, from the
argument parsers; `config.pbtxt`'s fields from the list the services act on (`config_reference`); the ensemble
YAML from its schema (`ensemble_schema`); the Stage API, `triton_python_backend_utils` and the Python client
from their modules (`python_api`); the gRPC API from `protos/` (`grpc_api`).

    python -m pipeline.docgen           # (re)write the pages (`make docs-reference`)
    python -m pipeline.docgen --check   # exit 1 if the committed pages differ from what the code gives

The flags default to their environment variables (`pipeline.runtime.settings`), so the parsers are built in an
environment without them: the pages show the defaults a process gets when nothing is set, whatever the
environment of the run that wrote them.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.docgen import config_reference, ensemble_schema, grpc_api, python_api
from pipeline.docgen.page import cell, header, slug

if TYPE_CHECKING:
    from pipeline.runtime.settings_cli import ProcessSettings

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "reference"
HEADER = header("the argument parsers")
#: Variables the processes read; the ensemble files' `${<STAGE>_ADDRESS}` among them.
_VARIABLE = re.compile(r"\b(?:PIPELINE_[A-Z0-9_]*[A-Z0-9]|[A-Z]+_ADDRESS)\b")


@dataclass(frozen=True)
class Command:
    """One command line: how it is typed, and its parser."""

    name: str
    parser: argparse.ArgumentParser


@contextmanager
def clean_environment() -> Iterator[None]:
    """No variable of ours (nor OpenTelemetry's) set, and a fixed terminal width for argparse's usage lines."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if _VARIABLE.fullmatch(name) or name.startswith("OTEL_"):
            del os.environ[name]
    os.environ["COLUMNS"] = "100"
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def commands() -> tuple[list[Command], list[Command]]:
    """The `pipeline` command with its subcommands, and the services' entry points, their parsers built in a
    clean environment."""
    from pipeline.cli import build_parser
    from pipeline.stage.service import python_service_parser
    from services.model.__main__ import build_parser as model_parser

    with clean_environment():
        top = build_parser()
        [subcommands] = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
        cli = [Command("pipeline", top)]
        cli += [Command(f"pipeline {name}", parser) for name, parser in subcommands.choices.items()]
        services = [
            Command("python -m services.preprocess", python_service_parser("preprocess")),
            Command("python -m services.model", model_parser()),
            Command("python -m services.postprocess", python_service_parser("postprocess")),
        ]
    return cli, services


def _help(action: argparse.Action, prog: str) -> str:
    """An action's help with argparse's `%(default)s`-style fields filled in, as `--help` prints it."""
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    fields = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    for key, value in fields.items():
        if hasattr(value, "__name__"):
            fields[key] = value.__name__
    if fields.get("choices") is not None:
        fields["choices"] = ", ".join(map(str, action.choices or ()))
    fields["prog"] = prog
    return action.help % fields


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction)):
        return ""
    value = action.default
    if value is None or value is argparse.SUPPRESS:
        return ""
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        if not value:
            return ""
        value = " ".join(map(str, sorted(value) if isinstance(value, (set, frozenset)) else value))
    return f"`{value}`" if str(value) != "" else ""


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    metavar = ""
    if action.nargs != 0:
        if action.choices is not None and action.metavar is None:
            metavar = " {" + ",".join(map(str, action.choices)) + "}"
        else:
            metavar = f" {action.metavar or action.dest.upper()}"
    return ", ".join(f"`{option}{metavar}`" for option in action.option_strings)


def _options(command: Command) -> Iterator[argparse.Action]:
    for action in command.parser._actions:
        if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        yield action


def command_section(command: Command, level: str = "##") -> str:
    """A command as Markdown: what it does, its usage line and a table of its arguments."""
    parser = command.parser
    lines = [f"{level} `{command.name}`", ""]
    description = parser.description or ""
    if description:
        lines += [cell(description), ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for subparsers in subcommands:
        lines += ["| subcommand | what it does |", "|---|---|"]
        for choice in subparsers._choices_actions:
            lines.append(
                f"| [`{choice.dest}`](#{slug(f'pipeline {choice.dest}')}) | {cell(choice.help or '')} |"
            )
        lines.append("")
    options = list(_options(command))
    if options:
        lines += ["| argument | default | what it does |", "|---|---|---|"]
        for action in options:
            lines.append(f"| {_flags(action)} | {_default(action)} | {cell(_help(action, parser.prog))} |")
        lines.append("")
    return "\n".join(lines)


def _settings() -> dict[str, type[ProcessSettings]]:
    """The settings model of each process, by its command: every `pipeline` subcommand's and every
    service's."""
    from pipeline.cli import subcommands
    from pipeline.runtime import settings

    pipeline = {f"pipeline {name}": command.settings for name, command in subcommands().items()}
    return {**pipeline, **settings.processes()}


def variables(groups: list[list[Command]]) -> dict[str, dict[str, list[str]]]:
    """Each environment variable that a flag reads (its settings model's, and those its help names):
    {variable: {flag: the commands that take it}}."""
    found: dict[str, dict[str, list[str]]] = {}
    models = _settings()
    for group in groups:
        for command in group:
            if command.name == "pipeline":
                continue
            model = models.get(command.name)
            declared = {name: option.env for name, option, _ in model.options()} if model is not None else {}
            for action in _options(command):
                flag = action.option_strings[0] if action.option_strings else action.dest
                # A positional argument reads no variable, whatever its help names (`pipeline trace`'s file).
                help_text = _help(action, command.parser.prog) if action.option_strings else ""
                named = _VARIABLE.findall(help_text)
                for name in filter(None, [declared.get(action.dest), *named]):
                    commands = found.setdefault(name, {}).setdefault(flag, [])
                    if command.name not in commands:
                        commands.append(command.name)
    return found


def _read_by(flags: dict[str, list[str]], servers: list[str]) -> str:
    """`--flag` of every server, or `--flag` of the commands listed, each a link to its reference."""
    parts = []
    for flag, commands in flags.items():
        others = [name for name in commands if name not in servers]
        every = set(servers) <= set(commands)
        links = [
            f"[`{name}`]({'cli' if name.startswith('pipeline') else 'services'}.md#{slug(name)})"
            for name in (others if every else commands)
        ]
        if every:
            links.append("the router and every stage service")
        parts.append(f"`{flag}` of {', '.join(links)}")
    return "; ".join(parts)


def settings_table() -> dict[str, str]:
    """Every variable the settings define, with its default: the processes' settings models', those a
    flag reads and those read without one (where several processes read one, the first default given)."""
    defaults: dict[str, Any] = {}
    for model in _settings().values():
        for _, found, field in model.variables():
            if found.env is not None and defaults.get(found.env) in (None, [], ()):
                defaults[found.env] = field.default
    table = {}
    for variable, default in defaults.items():
        if isinstance(default, (tuple, list, frozenset)):
            default = ",".join(map(str, sorted(default) if isinstance(default, frozenset) else default))
        table[variable] = "" if default is None or default == "" else f"`{default}`"
    return table


def environment_page(groups: list[list[Command]]) -> str:
    read_by = variables(groups)
    services = groups[-1]
    servers = ["pipeline router", *(command.name for command in services)]
    defaults = settings_table()
    lines = [
        "# Environment variables",
        "",
        "Every flag of the services and of `pipeline` defaults from an environment variable, so a container or",
        "a Compose file configures a process without its command line; a flag given wins over its variable, and",
        "an empty variable counts as unset. OpenTelemetry's own variables (`OTEL_*`) configure tracing: see",
        "[Observability](../observability.md).",
        "",
        "| variable | default | read by |",
        "|---|---|---|",
    ]
    tracing = _tracing_variables()
    for name in sorted(read_by.keys() | defaults.keys() | tracing.keys()):
        default, where = tracing.get(name, (defaults.get(name, ""), ""))
        where = _read_by(read_by.get(name, {}), servers) or where or "the processes' settings"
        lines.append(f"| `{name}` | {default} | {where} |")
    return "\n".join(lines) + "\n"


def _tracing_variables() -> dict[str, tuple[str, str]]:
    """The variables tracing reads beside OpenTelemetry's (`pipeline.runtime.telemetry`): {name: (default,
    read by)}."""
    from pipeline.runtime import telemetry

    return {
        "PIPELINE_TRACE_FILE": (
            f"`{telemetry.DEFAULT_TRACE_FILE}`",
            "the `jsonl` trace exporter of every server (`OTEL_TRACES_EXPORTER=jsonl`): the file it appends "
            "spans to",
        )
    }


def generate() -> dict[str, str]:
    """{file name under docs/reference/: content} of the generated pages."""
    cli, services = commands()
    cli_page = [
        "# The `pipeline` command",
        "",
        "Installed with the project (`.venv/bin/pipeline`, or `python -m pipeline`). Each flag's default comes",
        "from the environment variable its description names ([Environment variables](environment.md)).",
        "",
    ]
    cli_page += [command_section(command) for command in cli]
    services_page = [
        "# Services",
        "",
        "The stage services' entry points, as `pipeline run` starts them and as a container runs them; the",
        "router is [`pipeline router`](cli.md#pipeline-router). Each serves the Open Inference Protocol over",
        "gRPC, its health, and Prometheus metrics.",
        "",
    ]
    services_page += [command_section(command) for command in services]
    return {
        "cli.md": HEADER + "\n".join(cli_page).rstrip() + "\n",
        "services.md": HEADER + "\n".join(services_page).rstrip() + "\n",
        "environment.md": HEADER + environment_page([cli, services]),
        "model-config.md": config_reference.page(),
        "ensemble-yaml.md": ensemble_schema.page(),
        "stage-api.md": python_api.stage_api_page(),
        "pb-utils.md": python_api.pb_utils_page(),
        "python-client.md": python_api.python_client_page(),
        "grpc.md": grpc_api.page(),
    }


def stale() -> list[str]:
    """The generated pages that differ from what the parsers give now."""
    return sorted(
        name
        for name, content in generate().items()
        if not (OUT / name).is_file() or (OUT / name).read_text() != content
    )

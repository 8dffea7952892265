"""Every setting the servers read, and where each lives: one pydantic-settings model per process
(`RouterSettings` in `router_settings`; `stage_settings(service)` and `ModelServiceSettings` in
`service_settings`; `pipeline run`'s is `pipeline.tools.launcher_settings`, and `pipeline.cli.subcommands`
names every `pipeline` subcommand's), made of groups that the processes share (`server_settings`: `Limits`,
`Shutdown`, `Security`, `Logging`, ...) or their own. Each field declares its flag, its `PIPELINE_*`
variable, its help, its default and how its text is read (`pipeline.runtime.settings_cli.Option`, with the
parsers of `settings_values`); the command lines are built from the models (`add_arguments`), so a value
comes from its flag, else its variable, else the default. The variables are read when a command line is
parsed (or a server starts), never at import, and an empty variable counts as unset (as `${VAR:-default}`
does in the ensemble files and in Compose).

A setting that no flag sets (the tokens' lists and the stage token's file: secrets; the stages'
`<STAGE>_ADDRESS`; `PIPELINE_MAX_CONNECTION_AGE_S`) is a field with a variable and no flag, read with the
others; a client's (`pipeline infer`, `pipeline bench`) are the group `client_settings.Client`. A process
parses its command line into its model once (`ProcessSettings.parse`, or `pipeline.cli.parse` for a
`pipeline` subcommand) and hands its parts the groups they need (`settings.group(Security)`), typed: no
`argparse.Namespace` goes past the parser.

Variables that other tools define keep their own homes: OpenTelemetry's `OTEL_*` (read by its SDK and by
`pipeline.runtime.telemetry`) and the ensemble files' own `${VAR}`s.
"""

from __future__ import annotations

from pipeline.runtime.router_settings import RouterSettings
from pipeline.runtime.service_settings import ModelServiceSettings, stage_settings
from pipeline.runtime.settings_cli import ProcessSettings


def processes() -> dict[str, type[ProcessSettings]]:
    """The settings of every server, by its command (the launcher's: `pipeline.tools.launcher_settings`)."""
    return {
        "pipeline router": RouterSettings,
        **{f"python -m services.{stage}": stage_settings(stage) for stage in ("preprocess", "postprocess")},
        "python -m services.model": ModelServiceSettings,
    }

"""`pipeline run`'s settings: its flags and the `PIPELINE_*` variables they default from, one
pydantic-settings model (`LauncherSettings`) as each server's is (`pipeline.runtime.settings`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel

from pipeline.runtime.router_settings import Front, Readiness, http_port_option
from pipeline.runtime.server_settings import Logging, ModelControl, model_dir_option
from pipeline.runtime.settings_cli import Option, option, process_settings
from pipeline.runtime.settings_values import (
    DEFAULT_MODEL_DIR,
    PORTS,
    STAGES,
    names,
    port_or_off,
    positive_int,
)
from pipeline.runtime.shutdown import EXIT_MARGIN_S
from pipeline.tools.autoscaler import Autoscaling
from pipeline.tools.model_store import LauncherModelStore
from pipeline.tools.supervisor import KILL_MARGIN_S, RestartPolicy


def replica_counts(text: str) -> dict[str, int]:
    """An argparse type: `STAGE=N[,STAGE=N]`."""
    counts = {}
    for item in filter(None, text.split(",")):
        stage, _, count = item.partition("=")
        if stage not in STAGES or not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(
                f"expected STAGE=N with STAGE preprocess, model or postprocess: {item!r}"
            )
        counts[stage] = int(count)
    return counts


class LauncherPorts(BaseModel):
    """Where `pipeline run` starts its services."""

    host: Annotated[str, option("--host", env="PIPELINE_HOST", help="address every service binds")] = (
        "127.0.0.1"
    )
    port: Annotated[
        int,
        option(
            "--port", env="PIPELINE_ROUTER_PORT", parse=int, help="router port (env PIPELINE_ROUTER_PORT)"
        ),
    ] = PORTS["router"]
    http_port: Annotated[
        int | None,
        http_port_option(
            "router's HTTP/REST port, 0 for one the OS picks, 'off' for none (env PIPELINE_HTTP_PORT; "
            "default 8000)"
        ),
    ] = 8000


def _stage_port(stage: str) -> Option:
    """`--<stage>-port` of `pipeline run`."""
    env = f"PIPELINE_{stage.upper()}_PORT"
    return option(f"--{stage}-port", env=env, parse=int, help=f"{stage} service port (env {env})")


class LauncherStagePorts(BaseModel):
    """`pipeline run`'s `--preprocess-port`, `--model-port` and `--postprocess-port`."""

    preprocess_port: Annotated[int, _stage_port("preprocess")] = PORTS["preprocess"]
    model_port: Annotated[int, _stage_port("model")] = PORTS["model"]
    postprocess_port: Annotated[int, _stage_port("postprocess")] = PORTS["postprocess"]

    def stage_ports(self) -> dict[str, int]:
        """The three stages' ports by their names."""
        return {
            "preprocess": self.preprocess_port,
            "model": self.model_port,
            "postprocess": self.postprocess_port,
        }


class Launcher(BaseModel):
    """What `pipeline run` serves, and how it starts and stops its services."""

    metrics_port: Annotated[
        int | None,
        option(
            "--metrics-port",
            env="PIPELINE_ROUTER_METRICS_PORT",
            parse=port_or_off,
            help="router's Prometheus port, 'off' for none (env PIPELINE_ROUTER_METRICS_PORT; default 8002). "
            "Stages get ports the OS picks unless PIPELINE_<STAGE>_METRICS_PORT says otherwise; all are printed",
        ),
    ] = 8002
    ensembles: Annotated[
        Path,
        option(
            "--ensembles",
            env="PIPELINE_ENSEMBLES",
            parse=Path,
            help="folder of ensemble YAML files beside the model repository's ensembles; a missing or empty "
            "one adds none (env PIPELINE_ENSEMBLES; default %(default)s)",
        ),
    ] = Path("ensembles")
    model_dir: Annotated[
        Path,
        model_dir_option(
            "model repository: its models and ensembles are what is served (env PIPELINE_MODEL_DIR)"
        ),
    ] = DEFAULT_MODEL_DIR
    startup_timeout: Annotated[
        float, option("--startup-timeout", parse=float, help="seconds each service may take to start")
    ] = 180.0
    grace_period: Annotated[
        float,
        option(
            "--grace-period",
            parse=float,
            help="seconds each service's in-flight requests get on shutdown (after its drain delay); a service "
            f"still running {EXIT_MARGIN_S + KILL_MARGIN_S:.0f} s after that is killed",
        ),
    ] = 10.0


class Restarts(BaseModel):
    """When a process that keeps dying stops the pipeline (`pipeline.tools.supervisor`)."""

    restart_limit: Annotated[
        int,
        option(
            "--restart-limit",
            parse=positive_int,
            help="a process that dies is started again (after 0.5 s, doubling with each death in a row up to "
            "30 s); its N-th death within --restart-window seconds stops the pipeline instead, 1 stops it at "
            "the first death (default %(default)s)",
        ),
    ] = RestartPolicy().limit
    restart_window: Annotated[
        float,
        option(
            "--restart-window",
            parse=float,
            help="seconds over which --restart-limit counts a process's deaths (default %(default)s)",
        ),
    ] = RestartPolicy().window


class LauncherSecurity(BaseModel):
    """TLS on every hop of `pipeline run`, and its replicas."""

    tls_dir: Annotated[
        Path | None,
        option(
            "--tls-dir",
            env="PIPELINE_TLS_DIR",
            parse=Path,
            help="TLS on every hop from the files scripts/make-certs.sh writes there (ca.pem, server.pem, "
            "server-key.pem, client.pem, client-key.pem): stages accept only the router's client certificate "
            "(mutual TLS), the router serves TLS (env PIPELINE_TLS_DIR)",
        ),
    ] = None
    mtls: Annotated[
        bool,
        option(
            "--mtls",
            action="store_true",
            help="with --tls-dir, the router too asks its clients for a certificate signed by ca.pem",
        ),
    ] = False
    replicas: Annotated[
        dict[str, int],
        option(
            "--replicas",
            parse=replica_counts,
            metavar="STAGE=N[,STAGE=N]",
            help="run N processes of a stage (e.g. preprocess=2); the router spreads calls over them",
        ),
    ] = {}
    router_workers: Annotated[
        int,
        option(
            "--router-workers",
            env="PIPELINE_ROUTER_WORKERS",
            parse=int,
            help="router processes on the router's ports (SO_REUSEPORT), each batching its own share of the "
            "connections (env PIPELINE_ROUTER_WORKERS; default %(default)s)",
        ),
    ] = 1


class LauncherLoading(BaseModel):
    """`pipeline run --load-model`: Triton's explicit model control at start-up, for every service
    (`pipeline.tools.model_selection`)."""

    load_model: Annotated[
        list[str],
        option(
            "--load-model",
            env="PIPELINE_LOAD_MODEL",
            env_parse=names,
            action="append",
            metavar="NAME",
            help="load only this model or ensemble at start-up, an ensemble with the models its steps call, as "
            "Triton's --load-model (repeatable; env PIPELINE_LOAD_MODEL, comma-separated; '*' or none: every "
            "one): each stage service loads those of them it runs, the router serves the ensembles among them",
        ),
    ] = []


#: `pipeline run`. Its last groups are Triton's flags, which it passes on: to the router (`Readiness`), to every
#: service (`ModelControl`, `Logging`), and `--load-model` resolved for each (`pipeline.tools.model_selection`).
LauncherSettings = process_settings(
    "LauncherSettings",
    (
        LauncherPorts,
        LauncherStagePorts,
        Launcher,
        Restarts,
        Autoscaling,
        LauncherSecurity,
        LauncherModelStore,
        Front,
        Readiness,
        ModelControl,
        LauncherLoading,
        Logging,
    ),
)

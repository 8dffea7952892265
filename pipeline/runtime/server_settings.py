"""The groups of settings the servers share (each a pydantic model whose fields declare their flags and
variables): where a server listens, its limits, how it stops, its security and logging, Triton's model
control and instance limits, and the options of the model repository and ensembles."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel

from pipeline.runtime.settings_cli import Option, option
from pipeline.runtime.settings_values import (
    DEFAULT_MAX_CONNECTION_AGE_S,
    MODEL_CONTROL_MODES,
    PORTS,
    control_mode,
    identities,
    non_negative_int,
    paths,
    port_or_off,
    positive_int,
)
from pipeline.runtime.shutdown import EXIT_MARGIN_S


def _frames_help(service: str, variable: str) -> str:
    fast_path = (
        "the stages' fast path for their models' calls to other models (BLS)"
        if service == "router"
        else "the router's fast path to this service"
    )
    return (
        f"port of the frame protocol, {fast_path} (the protocol's messages on a stream of their own, with the "
        "TLS and client certificates of the gRPC port where it has them; gRPC serves everything else), 0 for "
        f"one the OS picks, 'off' for none (env {variable}; default %(default)s)"
    )


class Listening(BaseModel):
    """Where a server listens. Each service's own group (`listening(service)`) gives its ports their flags,
    variables and defaults."""

    host: Annotated[
        str,
        option(
            "--host",
            env="PIPELINE_HOST",
            help="address to listen on (env PIPELINE_HOST; 0.0.0.0 in containers)",
        ),
    ] = "127.0.0.1"
    port: int = 0
    port_file: Annotated[
        Path | None,
        option("--port-file", parse=Path, help="write the bound port to this file once listening"),
    ] = None
    metrics_port: int | None = None
    metrics_port_file: Annotated[
        Path | None,
        option("--metrics-port-file", parse=Path, help="write the bound metrics port to this file"),
    ] = None
    frames_port: int | None = None


@cache
def listening(service: str) -> type[Listening]:
    """Where a service listens (`PIPELINE_<SERVICE>_PORT`, `..._METRICS_PORT`, `..._FRAMES_PORT`): the
    router's metrics on 8002, a stage's on its port + 100."""
    env = f"PIPELINE_{service.upper()}"

    class ServiceListening(Listening):
        port: Annotated[
            int,
            option(
                "--port",
                env=f"{env}_PORT",
                parse=int,
                help=f"port to listen on, 0 for one the OS picks (env {env}_PORT)",
            ),
        ] = PORTS[service]
        metrics_port: Annotated[
            int | None,
            option(
                "--metrics-port",
                env=f"{env}_METRICS_PORT",
                parse=port_or_off,
                help="port of the Prometheus /metrics endpoint, 0 for one the OS picks, 'off' or negative for "
                f"none (env {env}_METRICS_PORT; default %(default)s)",
            ),
        ] = 8002 if service == "router" else PORTS[service] + 100
        frames_port: Annotated[
            int | None,
            option(
                "--frames-port",
                env=f"{env}_FRAMES_PORT",
                parse=port_or_off,
                help=_frames_help(service, f"{env}_FRAMES_PORT"),
            ),
        ] = 0

    ServiceListening.__name__ = ServiceListening.__qualname__ = f"{service.title()}Listening"
    return ServiceListening


class RouterLink(BaseModel):
    """Where a stage service's models send their calls to other models (Triton's BLS)."""

    router: Annotated[
        str | None,
        option(
            "--router",
            env="PIPELINE_ROUTER",
            metavar="HOST:PORT",
            help="the router, where the calls that models make to other models go (Triton's BLS: "
            "InferenceRequest.exec); without it such calls are answered with an error (env PIPELINE_ROUTER)",
        ),
    ] = None
    #: The clients' token, which the models' calls to the router present where it asks for one (no flag).
    router_token: Annotated[
        str | None, option(env="PIPELINE_TOKEN", help="the token the models' calls to the router present")
    ] = None
    router_port_file: Annotated[
        Path | None,
        option(
            "--router-port-file",
            parse=Path,
            help="read the router's port from this file (its --port-file) at the first call a model makes, "
            "for a router started after this service on a port the OS picks",
        ),
    ] = None


class Limits(BaseModel):
    """How much a server takes at once."""

    max_message_mb: Annotated[
        int,
        option(
            "--max-message-mb",
            env="PIPELINE_MAX_MESSAGE_MB",
            parse=positive_int,
            help="largest gRPC message accepted or sent, in MiB (env PIPELINE_MAX_MESSAGE_MB)",
        ),
    ] = 64
    max_inflight_mb: Annotated[
        int,
        option(
            "--max-inflight-mb",
            env="PIPELINE_MAX_INFLIGHT_MB",
            parse=non_negative_int,
            help="MiB of requests and responses held in flight at once: a unary request past it is refused "
            "with UNAVAILABLE, a stream is not read further until it fits; 0 for no limit "
            "(env PIPELINE_MAX_INFLIGHT_MB; default %(default)s)",
        ),
    ] = 256

    #: Clients reconnect after this long, and so look the server's name up again (no flag).
    max_connection_age_s: Annotated[
        float,
        option(
            env="PIPELINE_MAX_CONNECTION_AGE_S",
            parse=float,
            help="seconds after which a client's connection is recycled, so that it looks the name up again",
        ),
    ] = DEFAULT_MAX_CONNECTION_AGE_S

    @property
    def max_message_bytes(self) -> int:
        """`--max-message-mb` in bytes."""
        return self.max_message_mb * 1024 * 1024

    @property
    def max_inflight_bytes(self) -> int | None:
        """`--max-inflight-mb` in bytes; None where it is 0 (no limit)."""
        return self.max_inflight_mb * 1024 * 1024 if self.max_inflight_mb else None


class Shutdown(BaseModel):
    """How a server stops."""

    grace_period: Annotated[
        float,
        option(
            "--grace-period",
            env="PIPELINE_GRACE_PERIOD",
            parse=float,
            help="seconds in-flight requests get to finish on SIGTERM, after the drain delay; those still held "
            f"then are answered UNAVAILABLE, and the process exits at most {EXIT_MARGIN_S:.0f} s later (env "
            "PIPELINE_GRACE_PERIOD)",
        ),
    ] = 10.0
    drain_delay: Annotated[
        float,
        option(
            "--drain-delay",
            env="PIPELINE_DRAIN_DELAY",
            parse=float,
            help="seconds a stopping server keeps serving while reporting NOT_SERVING, so that clients move "
            "to other replicas first (env PIPELINE_DRAIN_DELAY)",
        ),
    ] = 1.0


class Security(BaseModel):
    """TLS and authentication (`pipeline.runtime.security`). Authentication is on when any token is
    configured, or client certificates are required (`--tls-ca`)."""

    tls_cert: Annotated[
        str | None,
        option(
            "--tls-cert",
            env="PIPELINE_TLS_CERT",
            help="PEM certificate (chain): serve with TLS only (env PIPELINE_TLS_CERT)",
        ),
    ] = None
    tls_key: Annotated[
        str | None, option("--tls-key", env="PIPELINE_TLS_KEY", help="PEM private key (env PIPELINE_TLS_KEY)")
    ] = None
    tls_ca: Annotated[
        str | None,
        option(
            "--tls-ca",
            env="PIPELINE_TLS_CA",
            help="PEM CA: clients must present a certificate signed by it, i.e. mutual TLS (env PIPELINE_TLS_CA)",
        ),
    ] = None
    auth_tokens_file: Annotated[
        str | None,
        option(
            "--auth-tokens-file",
            env="PIPELINE_AUTH_TOKENS_FILE",
            help="file of bearer tokens allowed to infer, one a line; with it (or PIPELINE_AUTH_TOKENS, "
            "comma-separated) every RPC but health needs 'authorization: Bearer <token>' "
            "(env PIPELINE_AUTH_TOKENS_FILE)",
        ),
    ] = None
    admin_tokens_file: Annotated[
        str | None,
        option(
            "--admin-tokens-file",
            env="PIPELINE_ADMIN_TOKENS_FILE",
            help="file of bearer tokens allowed everything, RepositoryModelLoad/Unload included (or "
            "PIPELINE_ADMIN_TOKENS, comma-separated; env PIPELINE_ADMIN_TOKENS_FILE)",
        ),
    ] = None
    tls_identities: Annotated[
        frozenset[str],
        option(
            "--tls-identities",
            env="PIPELINE_TLS_IDENTITIES",
            parse=identities,
            metavar="NAME[,NAME]",
            help="with --tls-ca: only client certificates whose subject CN or a subject alternative name is "
            "one of these may infer (default: every certificate the CA signed; env PIPELINE_TLS_IDENTITIES)",
        ),
    ] = frozenset()
    tls_admin_identities: Annotated[
        frozenset[str],
        option(
            "--tls-admin-identities",
            env="PIPELINE_TLS_ADMIN_IDENTITIES",
            parse=identities,
            metavar="NAME[,NAME]",
            help="with --tls-ca: client certificates whose subject CN or a subject alternative name is one of "
            "these may do everything, RepositoryModelLoad/Unload included (env PIPELINE_TLS_ADMIN_IDENTITIES)",
        ),
    ] = frozenset()
    #: Bearer tokens allowed to infer, comma-separated (a secret: no flag).
    auth_tokens: Annotated[
        str | None, option(env="PIPELINE_AUTH_TOKENS", help="bearer tokens allowed to infer, comma-separated")
    ] = None
    #: Bearer tokens allowed everything, comma-separated (a secret: no flag).
    admin_tokens: Annotated[
        str | None,
        option(env="PIPELINE_ADMIN_TOKENS", help="bearer tokens allowed everything, comma-separated"),
    ] = None


class _StageTokenFile(BaseModel):
    """The file that holds the router's stage token (a mounted secret), where no `--stage-token` gives it."""

    stage_token_file: Annotated[
        str | None,
        option(env="PIPELINE_STAGE_TOKEN_FILE", help="the file that holds the router's stage token"),
    ] = None


class RouterToken(_StageTokenFile):
    """The token the router sends its stages (`security.stage_token_of`)."""

    stage_token: Annotated[
        str | None,
        option(
            "--stage-token",
            env="PIPELINE_STAGE_TOKEN",
            help="bearer token the router sends to its stages, which accept it given the same setting "
            "(env PIPELINE_STAGE_TOKEN, or a file: PIPELINE_STAGE_TOKEN_FILE)",
        ),
    ] = None


class StageToken(_StageTokenFile):
    """The router's token, as a stage service accepts it."""

    stage_token: Annotated[
        str | None,
        option(
            "--stage-token",
            env="PIPELINE_STAGE_TOKEN",
            help="the router's token: accepted with the infer scope, as the router sends it with every stage "
            "call (env PIPELINE_STAGE_TOKEN, or a file: PIPELINE_STAGE_TOKEN_FILE)",
        ),
    ] = None


class Logging(BaseModel):
    log_level: Annotated[
        str, option("--log-level", env="PIPELINE_LOG_LEVEL", help="logging level (env PIPELINE_LOG_LEVEL)")
    ] = "INFO"
    log_verbose: Annotated[
        int,
        option(
            "--log-verbose",
            env="PIPELINE_LOG_VERBOSE",
            parse=non_negative_int,
            metavar="N",
            help="Triton's verbose logging: 1 or more logs at DEBUG level whatever --log-level says, 0 does not "
            "(env PIPELINE_LOG_VERBOSE; default %(default)s)",
        ),
    ] = 0

    @property
    def level(self) -> str:
        """The logging level asked for: DEBUG with `--log-verbose` 1 or more, else `--log-level`."""
        return "DEBUG" if self.log_verbose > 0 else self.log_level


class ModelControl(BaseModel):
    """Triton's model control: whether RepositoryModelLoad/Unload are allowed."""

    model_control_mode: Annotated[
        str,
        option(
            "--model-control-mode",
            env="PIPELINE_MODEL_CONTROL_MODE",
            parse=control_mode,
            metavar="{" + ",".join(MODEL_CONTROL_MODES) + "}",
            help="'explicit' allows RepositoryModelLoad/Unload (with an admin token configured, they need "
            "it); 'none' refuses them unless an admin token is configured (env PIPELINE_MODEL_CONTROL_MODE; "
            "default %(default)s, as Triton's)",
        ),
    ] = "none"

    @property
    def explicit(self) -> bool:
        """Whether explicit model control is asked for."""
        return self.model_control_mode == "explicit"


#: Instances one model version may have unless `--max-instances` says otherwise: more than enough threads
#: for any CPU model here, and a GPU model's count is per GPU.
DEFAULT_MAX_INSTANCES = 16


class Instances(BaseModel):
    max_instances: Annotated[
        int,
        option(
            "--max-instances",
            env="PIPELINE_MAX_INSTANCES",
            parse=positive_int,
            help="most instances one model version may have, whatever its instance_group asks "
            "(env PIPELINE_MAX_INSTANCES; default %(default)s)",
        ),
    ] = DEFAULT_MAX_INSTANCES


def model_dir_option(help: str) -> Option:
    """`--model-dir` (alias `--model-repository`, Triton's spelling; env `PIPELINE_MODEL_DIR`)."""
    return option("--model-dir", "--model-repository", env="PIPELINE_MODEL_DIR", parse=Path, help=help)


def ensembles_option(help: str) -> Option:
    """`--ensembles`, of the router and of a Python stage service: YAML files or folders of them."""
    return option("--ensembles", env="PIPELINE_ENSEMBLES", parse=Path, env_parse=paths, nargs="+", help=help)

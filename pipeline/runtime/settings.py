"""Every setting the servers read, in one place: one pydantic-settings model per process (`RouterSettings`,
`stage_settings(service)`, `ModelServiceSettings`; `pipeline run`'s is `pipeline.tools.launcher_settings`),
made of groups that the processes share (`Limits`, `Shutdown`, `Security`, `Logging`, ...). Each field
declares its flag, its `PIPELINE_*` variable, its help, its default and how its text is read
(`pipeline.runtime.settings_cli.Option`); the command lines are built from the models (`add_arguments`), so a
value comes from its flag, else its variable, else the default. The variables are read when a command line is parsed (or a server starts), never at import,
and an empty variable counts as unset (as `${VAR:-default}` does in the ensemble files and in Compose).

The variables that no server flag sets (the tokens' lists, the stages' addresses, the clients' settings),
and the few that other code reads beside a flag, are `Setting`s below; both kinds are read alike
(`pipeline.runtime.settings_cli.read_variable`).

Variables that other tools define keep their own homes: OpenTelemetry's `OTEL_*` (read by its SDK and by
`pipeline.runtime.telemetry`) and the ensemble files' own `${VAR}`s.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Generic, TypeVar

from pydantic import BaseModel

from pipeline.runtime.settings_cli import (
    Option,
    ProcessSettings,
    option,
    process_settings,
    read_variable,
    variable_text,
)
from pipeline.runtime.shutdown import EXIT_MARGIN_S

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Setting(Generic[T]):
    """One environment variable that no server flag sets: its name, its default, and how its text becomes a
    value (read as the settings models' variables are: `pipeline.runtime.settings_cli.read_variable`)."""

    variable: str
    default: T
    parse: Callable[[str], T]

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value the environment (`os.environ` by default) gives, else the default; `SettingError` names
        a variable that does not parse."""
        given, value = read_variable(self.variable, self.parse, environ)
        return value if given else self.default

    def given(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the environment sets the variable (to something other than blanks)."""
        return bool(variable_text(self.variable, environ))


def byte_count(text: str) -> int:
    """A number of bytes, with an optional k, M or G suffix (powers of 1024): `64M`, `1048576`."""
    text = text.strip()
    scale = {"k": 1024, "m": 1024**2, "g": 1024**3}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes such as 1048576 or 64M, got {text!r}"
        ) from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"a size cannot be negative, got {text!r}")
    return size


def port_or_off(text: str) -> int | None:
    """A port, 0 for one the OS picks, `off` (or a negative number) for none."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number or 'off', got {text!r}") from None
    return None if port < 0 else port


def names(text: str) -> tuple[str, ...]:
    """Comma-separated names, blanks dropped."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def flag(text: str) -> bool:
    """A yes/no variable: anything but 0, false, no and off is yes."""
    return text.strip().lower() not in ("0", "false", "no", "off")


#: A boolean's spellings, as Triton reads its boolean flags (`--exit-on-error=false`).
BOOLEANS = {
    "true": True,
    "1": True,
    "on": True,
    "yes": True,
    "false": False,
    "0": False,
    "off": False,
    "no": False,
}


def boolean(text: str) -> bool:
    """An argparse type: a boolean as Triton's flags take it (true, false, 1, 0; on, off, yes, no)."""
    try:
        return BOOLEANS[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected true or false (or 1 or 0), got {text!r}") from None


def _optional(text: str) -> str | None:
    return text


def positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def non_negative_int(value: str) -> int:
    """An argparse type: an integer of at least 0."""
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {number}")
    return number


def identities(text: str) -> frozenset[str]:
    """An argparse type: comma-separated certificate identities."""
    return frozenset(names(text))


def stage_argument(value: str) -> tuple[str, str]:
    """An argparse type: `NAME=ADDRESS`."""
    name, sep, address = value.partition("=")
    if not sep or not name.strip() or not address.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=ADDRESS (e.g. model=127.0.0.1:8102), got {value!r}")
    return name.strip(), address.strip()


def _paths(text: str) -> list[Path]:
    """A variable that names one path, as the value of a flag that takes several."""
    return [Path(text)]


#: Triton's model control modes that the services take (`poll` is not one: nothing here polls).
MODEL_CONTROL_MODES = ("none", "explicit")


def control_mode(value: str) -> str:
    """An argparse type: one of `MODEL_CONTROL_MODES`."""
    mode = value.strip().lower() or "none"
    if mode not in MODEL_CONTROL_MODES:
        raise argparse.ArgumentTypeError(
            f"model control mode must be one of {', '.join(MODEL_CONTROL_MODES)}, got {value!r}"
        )
    return mode


#: The services and their default gRPC ports; each serves Prometheus metrics on its port plus 100, the
#: router on 8002 (and HTTP/REST on 8000).
PORTS: Mapping[str, int] = {"router": 8001, "preprocess": 8101, "model": 8102, "postprocess": 8103}
#: The stages, in the order requests pass them.
STAGES = ("preprocess", "model", "postprocess")


def stage_address(stage: str) -> Setting[str]:
    """`<STAGE>_ADDRESS`: where the router calls a stage, as the example ensembles' `${..._ADDRESS}` say."""
    return Setting(f"{stage.upper()}_ADDRESS", f"127.0.0.1:{PORTS[stage]}", str)


# --- the variables read without a server's parser -----------------------------------------------------------
# Those that no server flag sets, and those that other code reads too, whose flags' options name them here:
# PIPELINE_MODEL_DIR (`pipeline quantize`), PIPELINE_RESOLVE_INTERVAL_S (the router's replicas), the token
# files (the launcher).

#: Clients reconnect after this long, and so look the server's name up again.
MAX_CONNECTION_AGE_S = Setting("PIPELINE_MAX_CONNECTION_AGE_S", 30.0, float)
#: The model repository of the tools that read one (the services' is their `--model-dir`).
MODEL_DIR = Setting("PIPELINE_MODEL_DIR", Path("model_repository"), Path)
#: Seconds between look-ups of the stages' DNS names (the router's `--resolve-interval`).
RESOLVE_INTERVAL_S = Setting("PIPELINE_RESOLVE_INTERVAL_S", 5.0, float)
# Security (pipeline.runtime.security): the tokens' lists, and the router's token for its stages.
AUTH_TOKENS: Setting[str | None] = Setting("PIPELINE_AUTH_TOKENS", None, _optional)
AUTH_TOKENS_FILE: Setting[str | None] = Setting("PIPELINE_AUTH_TOKENS_FILE", None, _optional)
ADMIN_TOKENS: Setting[str | None] = Setting("PIPELINE_ADMIN_TOKENS", None, _optional)
ADMIN_TOKENS_FILE: Setting[str | None] = Setting("PIPELINE_ADMIN_TOKENS_FILE", None, _optional)
STAGE_TOKEN: Setting[str | None] = Setting("PIPELINE_STAGE_TOKEN", None, _optional)
STAGE_TOKEN_FILE: Setting[str | None] = Setting("PIPELINE_STAGE_TOKEN_FILE", None, _optional)
# The clients (`pipeline infer`, `pipeline bench`).
URL = Setting("PIPELINE_URL", "127.0.0.1:8001", str)
TOKEN: Setting[str | None] = Setting("PIPELINE_TOKEN", None, _optional)


# --- the groups of flags the servers share -----------------------------------------------------------------


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


@cache
def listening(service: str) -> type[BaseModel]:
    """Where a service listens (`PIPELINE_<SERVICE>_PORT`, `..._METRICS_PORT`, `..._FRAMES_PORT`): the
    router's metrics on 8002, a stage's on its port + 100."""
    env = f"PIPELINE_{service.upper()}"

    class Listening(BaseModel):
        host: Annotated[
            str,
            option(
                "--host",
                env="PIPELINE_HOST",
                help="address to listen on (env PIPELINE_HOST; 0.0.0.0 in containers)",
            ),
        ] = "127.0.0.1"
        port: Annotated[
            int,
            option(
                "--port",
                env=f"{env}_PORT",
                parse=int,
                help=f"port to listen on, 0 for one the OS picks (env {env}_PORT)",
            ),
        ] = PORTS[service]
        port_file: Annotated[
            Path | None,
            option("--port-file", parse=Path, help="write the bound port to this file once listening"),
        ] = None
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
        metrics_port_file: Annotated[
            Path | None,
            option("--metrics-port-file", parse=Path, help="write the bound metrics port to this file"),
        ] = None
        frames_port: Annotated[
            int | None,
            option(
                "--frames-port",
                env=f"{env}_FRAMES_PORT",
                parse=port_or_off,
                help=_frames_help(service, f"{env}_FRAMES_PORT"),
            ),
        ] = 0

    Listening.__name__ = Listening.__qualname__ = f"{service.title()}Listening"
    return Listening


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


def inflight_bytes_of(args: argparse.Namespace) -> int | None:
    """`--max-inflight-mb` in bytes; None where it is 0 (no limit)."""
    mib = getattr(args, "max_inflight_mb", Limits().max_inflight_mb)
    return mib * 1024 * 1024 if mib else None


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
            env=AUTH_TOKENS_FILE.variable,
            help="file of bearer tokens allowed to infer, one a line; with it (or PIPELINE_AUTH_TOKENS, "
            "comma-separated) every RPC but health needs 'authorization: Bearer <token>' "
            "(env PIPELINE_AUTH_TOKENS_FILE)",
        ),
    ] = None
    admin_tokens_file: Annotated[
        str | None,
        option(
            "--admin-tokens-file",
            env=ADMIN_TOKENS_FILE.variable,
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


class RouterToken(BaseModel):
    """The token the router sends its stages (its variables are read by `security.stage_token_of`)."""

    stage_token: Annotated[
        str | None,
        option(
            "--stage-token",
            help="bearer token the router sends to its stages, which accept it given the same setting "
            "(env PIPELINE_STAGE_TOKEN, or a file: PIPELINE_STAGE_TOKEN_FILE)",
        ),
    ] = None


class StageToken(BaseModel):
    """The router's token, as a stage service accepts it."""

    stage_token: Annotated[
        str | None,
        option(
            "--stage-token",
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


def log_level_of(args: argparse.Namespace) -> str:
    """The logging level a server's flags ask for: DEBUG with `--log-verbose` 1 or more, else `--log-level`."""
    return "DEBUG" if getattr(args, "log_verbose", 0) > 0 else str(args.log_level)


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


# --- the router ----------------------------------------------------------------------------------------------


def model_dir_option(help: str) -> Option:
    """`--model-dir` (alias `--model-repository`, Triton's spelling; env `PIPELINE_MODEL_DIR`)."""
    return option("--model-dir", "--model-repository", env=MODEL_DIR.variable, parse=Path, help=help)


def _ensembles(help: str) -> Option:
    """`--ensembles`, of the router and of a Python stage service: YAML files or folders of them."""
    return option("--ensembles", env="PIPELINE_ENSEMBLES", parse=Path, env_parse=_paths, nargs="+", help=help)


class Catalog(BaseModel):
    """What the router serves: the ensembles, the model repository and the stages."""

    ensembles: Annotated[
        list[Path],
        _ensembles(
            "ensemble YAML files or folders of them, beside the model repository's ensembles; a missing or "
            "empty folder adds none (env PIPELINE_ENSEMBLES; default: ensembles)"
        ),
    ] = [Path("ensembles")]
    model_dir: Annotated[
        Path | None,
        model_dir_option(
            "the Triton model repository the stages serve: its ensembles are served, config.pbtxt ones "
            '(platform "ensemble") and YAML ones (<ensemble>/ensemble.yaml) (env PIPELINE_MODEL_DIR)'
        ),
    ] = None
    stage: Annotated[
        list[tuple[str, str]] | None,
        option(
            "--stage",
            parse=stage_argument,
            action="append",
            metavar="NAME=ADDRESS",
            help="a stage service the router calls (repeatable): it serves the steps that name it, and the "
            "steps that name no stage whose model its RepositoryIndex lists; every model of its repository is "
            "served here too. Default with --model-dir: "
            + ", ".join(
                f"{stage}=${stage_address(stage).variable} (else {stage_address(stage).default})"
                for stage in STAGES
            ),
        ),
    ] = None


class RouterOptions(BaseModel):
    """How the router batches, caches, scales and watches its stages and ensembles."""

    max_inflight_requests: Annotated[
        int,
        option(
            "--max-inflight-requests",
            env="PIPELINE_MAX_INFLIGHT_REQUESTS",
            parse=int,
            help="inference requests held at once; more are refused with UNAVAILABLE, so memory stays bounded "
            "under overload; 0 for no limit (env PIPELINE_MAX_INFLIGHT_REQUESTS; default %(default)s)",
        ),
    ] = 1024
    cache_size: Annotated[
        int,
        option(
            "--cache-size",
            env="PIPELINE_CACHE_SIZE",
            parse=byte_count,
            help="bytes of the response cache (suffixes k, M, G: powers of 1024), for the stage models and "
            "ensembles whose config enables response_cache; Triton's --cache-config local,size=N; 0 turns it "
            "off (env PIPELINE_CACHE_SIZE; default %(default)s)",
        ),
    ] = 0
    max_batch_items: Annotated[
        int,
        option(
            "--max-batch-items",
            env="PIPELINE_MAX_BATCH_ITEMS",
            parse=positive_int,
            help="items (dimension 0) one request may carry, whatever the model allows "
            "(env PIPELINE_MAX_BATCH_ITEMS; default %(default)s)",
        ),
    ] = 1024
    workers: Annotated[
        int,
        option(
            "--workers",
            env="PIPELINE_ROUTER_WORKERS",
            parse=positive_int,
            help="router processes serving the same ports (SO_REUSEPORT: the kernel spreads connections over "
            "them); each batches its own share, and metrics and statistics cover them all "
            "(env PIPELINE_ROUTER_WORKERS; default %(default)s)",
        ),
    ] = 1
    resolve_interval: Annotated[
        float,
        option(
            "--resolve-interval",
            env=RESOLVE_INTERVAL_S.variable,
            parse=float,
            help="seconds between look-ups of the stages' DNS names: a new replica gets calls, and one that "
            "is gone stops getting them, within about this long (env PIPELINE_RESOLVE_INTERVAL_S; default "
            "%(default)s)",
        ),
    ] = RESOLVE_INTERVAL_S.default
    repository_poll_secs: Annotated[
        float,
        option(
            "--repository-poll-secs",
            env="PIPELINE_REPOSITORY_POLL_SECS",
            parse=float,
            help="seconds between looks at the ensemble files (--ensembles, and the model repository's "
            "ensembles) for changes, as Triton's poll mode: a changed, added or removed file is loaded, and "
            "one that fails keeps its last good plan; 0 never looks (env PIPELINE_REPOSITORY_POLL_SECS; "
            "default %(default)s)",
        ),
    ] = 0.0


class Readiness(BaseModel):
    """When the router is ready, and whether an ensemble that fails stops it: Triton's `--strict-readiness` and
    `--exit-on-error` (`pipeline run` passes them on)."""

    strict_readiness: Annotated[
        bool,
        option(
            "--strict-readiness",
            env="PIPELINE_STRICT_READINESS",
            parse=boolean,
            metavar="BOOL",
            help="true: ready (ServerReady, the health of inference.GRPCInferenceService, /v2/health/ready) "
            "only while every ensemble is available and every stage healthy, as Triton's default; false: "
            "ready once started, each model's readiness its own (env PIPELINE_STRICT_READINESS; default "
            "%(default)s)",
        ),
    ] = True
    exit_on_error: Annotated[
        bool,
        option(
            "--exit-on-error",
            env="PIPELINE_EXIT_ON_ERROR",
            parse=boolean,
            metavar="BOOL",
            help="true: an ensemble that fails to load or to check against its models stops the router at "
            "start-up, as Triton's default; false: the router serves the others, and lists the failed one as "
            "UNAVAILABLE with the reason (RepositoryIndex; ModelReady false; requests get UNAVAILABLE) "
            "(env PIPELINE_EXIT_ON_ERROR; default %(default)s)",
        ),
    ] = True


class EnsembleLoading(BaseModel):
    """The router's `--load-model`: Triton's explicit model control at start-up, for the ensembles."""

    load_model: Annotated[
        list[str],
        option(
            "--load-model",
            env="PIPELINE_ROUTER_LOAD_MODEL",
            env_parse=names,
            action="append",
            metavar="NAME",
            help="serve only the ensembles named and those their steps call, as Triton loads a named ensemble "
            "with its models (repeatable; env PIPELINE_ROUTER_LOAD_MODEL, comma-separated; '*' or none: every "
            "ensemble); the stages' models are served as their stages load them (their own --load-model)",
        ),
    ] = []


#: `--front`: who serves the router's public gRPC port.
FRONTS = ("auto", "compiled", "python")


def front_choice(value: str) -> str:
    if value not in FRONTS:
        raise argparse.ArgumentTypeError(f"{value!r}: one of {', '.join(FRONTS)}")
    return value


class Front(BaseModel):
    """Who serves the router's public gRPC port (`pipeline.router.front`)."""

    front: Annotated[
        str,
        option(
            "--front",
            env="PIPELINE_FRONT",
            parse=front_choice,
            metavar="{auto,compiled,python}",
            help="compiled: the gRPC port is served by pipeline-front (C++, grpc++), which hands each ModelInfer "
            "to the router as a frame and forwards every other RPC to the router's own gRPC server on loopback; "
            "python: the router's own gRPC server serves it; auto: compiled where the binary is there "
            "(make front), else python, said in one line (env PIPELINE_FRONT; default %(default)s)",
        ),
    ] = "auto"


def http_port_option(help: str) -> Option:
    """`--http-port` (env `PIPELINE_HTTP_PORT`): the router's HTTP/REST port, 'off' for none."""
    return option("--http-port", env="PIPELINE_HTTP_PORT", parse=port_or_off, help=help)


class Http(BaseModel):
    """The router's HTTP/REST side (`pipeline.router.frontdoor.http`)."""

    http_port: Annotated[
        int | None,
        http_port_option(
            "port of the HTTP/REST side of the protocol, 0 for one the OS picks, 'off' for none "
            "(env PIPELINE_HTTP_PORT; default %(default)s)"
        ),
    ] = 8000
    http_port_file: Annotated[
        Path | None, option("--http-port-file", parse=Path, help="write the bound HTTP port to this file")
    ] = None
    max_json_output_mb: Annotated[
        int,
        option(
            "--max-json-output-mb",
            env="PIPELINE_MAX_JSON_OUTPUT_MB",
            parse=int,
            help="the most megabytes of JSON a response's outputs may take; a larger one is refused, telling "
            "the client to ask for binary data (binary_data_output), which has no such limit; 0 for no limit "
            "(env PIPELINE_MAX_JSON_OUTPUT_MB; default %(default)s)",
        ),
    ] = 64
    http_codec_processes: Annotated[
        int,
        option(
            "--http-codec-processes",
            env="PIPELINE_HTTP_CODEC_PROCESSES",
            parse=int,
            help="worker processes that decode large or compressed request bodies and encode large JSON "
            "responses, off the event loop that gRPC shares; as many such requests are handled at once, the "
            "others wait their turn; 0 does it all on the event loop "
            "(env PIPELINE_HTTP_CODEC_PROCESSES; default %(default)s)",
        ),
    ] = 2


class TorchServeStore(BaseModel):
    """TorchServe's model store: the folder of `.mar` archives that TorchServe's management API at the router
    registers models from (`pipeline.router.frontdoor.torchserve_api`)."""

    model_store: Annotated[
        Path | None,
        option(
            "--model-store",
            env="PIPELINE_MODEL_STORE",
            parse=Path,
            help="folder of TorchServe model archives (.mar): TorchServe's Inference and Management APIs are "
            "served on the HTTP port, POST /models?url=NAME.mar registers one (env PIPELINE_MODEL_STORE)",
        ),
    ] = None


#: What each of a client's TLS files is for (the router's `--stage-tls-*`, the clients' `--tls-*`).
CLIENT_TLS_HELP = {
    "ca": "PEM CA that signed the server's certificate (turns TLS on)",
    "cert": "PEM client certificate, for servers that require one (mutual TLS)",
    "key": "PEM key of the client certificate",
}


class StageTls(BaseModel):
    """The TLS of the router's calls to its stages (`pipeline.runtime.security.client_tls`)."""

    stage_tls_ca: Annotated[
        str | None,
        option(
            "--stage-tls-ca",
            env="PIPELINE_STAGE_TLS_CA",
            help=f"{CLIENT_TLS_HELP['ca']} (env PIPELINE_STAGE_TLS_CA)",
        ),
    ] = None
    stage_tls_cert: Annotated[
        str | None,
        option(
            "--stage-tls-cert",
            env="PIPELINE_STAGE_TLS_CERT",
            help=f"{CLIENT_TLS_HELP['cert']} (env PIPELINE_STAGE_TLS_CERT)",
        ),
    ] = None
    stage_tls_key: Annotated[
        str | None,
        option(
            "--stage-tls-key",
            env="PIPELINE_STAGE_TLS_KEY",
            help=f"{CLIENT_TLS_HELP['key']} (env PIPELINE_STAGE_TLS_KEY)",
        ),
    ] = None


# --- the stage services ----------------------------------------------------------------------------------------


@cache
def loading(service: str) -> type[BaseModel]:
    """`--load-model NAME` (repeatable; env `PIPELINE_<SERVICE>_LOAD_MODEL`, names separated by commas),
    Triton's explicit model control: serve only the models named instead of every one the service runs."""
    env = f"PIPELINE_{service.upper()}_LOAD_MODEL"

    class Loading(BaseModel):
        load_model: Annotated[
            list[str],
            option(
                "--load-model",
                env=env,
                env_parse=names,
                action="append",
                metavar="NAME",
                help=f"serve only this repository model (repeatable; env {env}, comma-separated); without "
                "it, or with '*' (Triton's), the models of the repository that run in this service; a blank NAME "
                "alone, none of them",
            ),
        ] = []

    Loading.__name__ = Loading.__qualname__ = f"{service.title()}Loading"
    return Loading


class Repository(BaseModel):
    """The model repository of a Python stage service."""

    model_dir: Annotated[
        Path,
        model_dir_option(
            "the model repository, in Triton's layout (env PIPELINE_MODEL_DIR; default %(default)s)"
        ),
    ] = MODEL_DIR.default


class StageEnsembles(BaseModel):
    """The YAML ensembles a Python stage service reads to know which of the repository's Python models it
    serves (`pipeline.stage.placement`)."""

    ensembles: Annotated[
        list[Path],
        _ensembles(
            "ensemble YAML files or folders of them, as the router's; a missing or empty folder adds none "
            "(env PIPELINE_ENSEMBLES; default: ensembles)"
        ),
    ] = [Path("ensembles")]


def _stage_groups(service: str) -> tuple[type[BaseModel], ...]:
    """The flags every stage service takes."""
    return (listening(service), RouterLink, Limits, Shutdown, Security, StageToken, Logging)


@cache
def stage_settings(service: str) -> type[ProcessSettings]:
    """`python -m services.<service>` of a Python stage service (preprocess, postprocess)."""
    groups: tuple[type[BaseModel], ...] = (
        *_stage_groups(service),
        Repository,
        loading(service),
        ModelControl,
        Instances,
        StageEnsembles,
    )
    return process_settings(f"{service.title()}Settings", groups)


class ModelRepository(BaseModel):
    """The model repository of the model service."""

    model_dir: Annotated[
        Path,
        model_dir_option(
            "Triton model repository: <model>/config.pbtxt and <model>/<version>/model.{onnx,pt,pt2,plan}; "
            "the models whose backend is onnxruntime, pytorch or tensorrt are served, and the python models "
            "whose instance_group asks for KIND_GPU (env PIPELINE_MODEL_DIR; default %(default)s)"
        ),
    ] = MODEL_DIR.default


class Runners(BaseModel):
    """How the model service runs its models (`services.model.backend.ServiceSettings`)."""

    engine_cache: Annotated[
        str | None,
        option(
            "--engine-cache",
            env="PIPELINE_ENGINE_CACHE",
            help="folder of built TensorRT engines (env PIPELINE_ENGINE_CACHE; default <model-dir>/.engines)",
        ),
    ] = None
    device: Annotated[
        str,
        option(
            "--device",
            env="PIPELINE_DEVICE",
            help="where instances of kind KIND_AUTO go: auto (a GPU when one is visible, else the CPU), cpu, "
            "cuda or cuda:N (env PIPELINE_DEVICE; default %(default)s)",
        ),
    ] = "auto"
    torch_threads: Annotated[
        int,
        option(
            "--torch-threads",
            "--intra-op-threads",
            env="PIPELINE_TORCH_THREADS",
            parse=positive_int,
            help="intra-op threads of each instance, torch and ONNX Runtime alike, unless its config's "
            "intra_op_thread_count says otherwise; raise only after measuring (env PIPELINE_TORCH_THREADS; "
            "default %(default)s)",
        ),
    ] = 1
    disable_auto_complete_config: Annotated[
        bool,
        option(
            "--disable-auto-complete-config",
            env="PIPELINE_DISABLE_AUTO_COMPLETE_CONFIG",
            parse=flag,
            action="store_true",
            help="do not complete configs from the model files: every model needs a config.pbtxt declaring "
            "its inputs, outputs and max_batch_size (env PIPELINE_DISABLE_AUTO_COMPLETE_CONFIG)",
        ),
    ] = False
    default_max_batch_size: Annotated[
        int,
        option(
            "--default-max-batch-size",
            env="PIPELINE_DEFAULT_MAX_BATCH_SIZE",
            parse=positive_int,
            help="max_batch_size that auto-complete gives a model that batches, as Triton's "
            "default-max-batch-size (env PIPELINE_DEFAULT_MAX_BATCH_SIZE; default %(default)s)",
        ),
    ] = 4
    strict_runner: Annotated[
        bool,
        option(
            "--strict-runner",
            env="PIPELINE_STRICT_RUNNER",
            parse=flag,
            action="store_true",
            help="fail a model whose first runner cannot build or load it, instead of falling back to the next "
            "(TensorRT, ONNX Runtime CUDA, torch CUDA, CPU); a config's strict_runner parameter says otherwise "
            "for its model (env PIPELINE_STRICT_RUNNER)",
        ),
    ] = False


#: `python -m services.model`.
ModelServiceSettings = process_settings(
    "ModelServiceSettings",
    (*_stage_groups("model"), ModelControl, Instances, ModelRepository, loading("model"), Runners),
)
#: `pipeline router`.
RouterSettings = process_settings(
    "RouterSettings",
    (
        listening("router"),
        Limits,
        Shutdown,
        Security,
        RouterToken,
        Logging,
        Catalog,
        RouterOptions,
        Front,
        Readiness,
        ModelControl,
        EnsembleLoading,
        Http,
        TorchServeStore,
        StageTls,
    ),
)


def processes() -> dict[str, type[ProcessSettings]]:
    """The settings of every server, by its command (the launcher's: `pipeline.tools.launcher_settings`)."""
    return {
        "pipeline router": RouterSettings,
        **{f"python -m services.{stage}": stage_settings(stage) for stage in ("preprocess", "postprocess")},
        "python -m services.model": ModelServiceSettings,
    }

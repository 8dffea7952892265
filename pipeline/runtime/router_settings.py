"""The router's groups of settings (what it serves, how it batches, caches and scales, who serves its
gRPC port, its HTTP/REST port, the TorchServe model store, the TLS of its stage calls) and `RouterSettings`,
the settings model of `pipeline router`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel

from pipeline.runtime.server_settings import (
    Limits,
    Logging,
    ModelControl,
    RouterToken,
    Security,
    Shutdown,
    ensembles_option,
    listening,
    model_dir_option,
)
from pipeline.runtime.settings_cli import Option, option, process_settings
from pipeline.runtime.settings_values import (
    CLIENT_TLS_HELP,
    DEFAULT_RESOLVE_INTERVAL_S,
    PORTS,
    STAGES,
    boolean,
    byte_count,
    names,
    non_negative_int,
    port_or_off,
    positive_int,
    stage_argument,
)


def _address(stage: str) -> Option:
    """`<STAGE>_ADDRESS`, read from the environment alone."""
    return option(env=f"{stage.upper()}_ADDRESS", help=f"where the router calls the {stage} stage")


class Catalog(BaseModel):
    """What the router serves: the ensembles, the model repository and the stages."""

    ensembles: Annotated[
        list[Path],
        ensembles_option(
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
                f"{stage}=${stage.upper()}_ADDRESS (else 127.0.0.1:{PORTS[stage]})" for stage in STAGES
            ),
        ),
    ] = None
    #: Where the router calls each stage without `--stage` (as the example ensembles' `${..._ADDRESS}` say).
    preprocess_address: Annotated[str, _address("preprocess")] = f"127.0.0.1:{PORTS['preprocess']}"
    model_address: Annotated[str, _address("model")] = f"127.0.0.1:{PORTS['model']}"
    postprocess_address: Annotated[str, _address("postprocess")] = f"127.0.0.1:{PORTS['postprocess']}"

    def stage_addresses(self) -> dict[str, str]:
        """The three stages' addresses by their names, as `<STAGE>_ADDRESS` gives them."""
        return {
            "preprocess": self.preprocess_address,
            "model": self.model_address,
            "postprocess": self.postprocess_address,
        }


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
            env="PIPELINE_RESOLVE_INTERVAL_S",
            parse=float,
            help="seconds between look-ups of the stages' DNS names: a new replica gets calls, and one that "
            "is gone stops getting them, within about this long (env PIPELINE_RESOLVE_INTERVAL_S; default "
            "%(default)s)",
        ),
    ] = DEFAULT_RESOLVE_INTERVAL_S
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
    front_merge_inflight: Annotated[
        int,
        option(
            "--front-merge-inflight",
            env="PIPELINE_FRONT_MERGE_INFLIGHT",
            parse=non_negative_int,
            help="with the compiled front: how many requests (or merged requests) of a model the router batches "
            "(a stage model with dynamic_batching, an ensemble whose every step is batched) it has at the router at "
            "once; those that come meanwhile wait at the front and go on as "
            "one request when one comes back (0: never merge; env PIPELINE_FRONT_MERGE_INFLIGHT; default "
            "%(default)s)",
        ),
    ] = 2


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

"""The stage services' groups of settings (which models a service loads, its model repository and
ensembles, how the model service runs its models) and their settings models: `stage_settings(service)` of a
Python stage service, `ModelServiceSettings` of the model service."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field

from pipeline.runtime.server_settings import (
    Instances,
    Limits,
    Logging,
    ModelControl,
    RouterLink,
    Security,
    Shutdown,
    StageToken,
    ensembles_option,
    listening,
    model_dir_option,
)
from pipeline.runtime.settings_cli import ProcessSettings, option, process_settings
from pipeline.runtime.settings_values import DEFAULT_MODEL_DIR, device_name, flag, names, positive_int


class Loading(BaseModel):
    """The models a service loads at start-up (Triton's `--load-model`); each service's own group
    (`loading(service)`) gives the flag its variable."""

    load_model: list[str] = []


@cache
def loading(service: str) -> type[Loading]:
    """`--load-model NAME` (repeatable; env `PIPELINE_<SERVICE>_LOAD_MODEL`, names separated by commas),
    Triton's explicit model control: serve only the models named instead of every one the service runs."""
    env = f"PIPELINE_{service.upper()}_LOAD_MODEL"

    class ServiceLoading(Loading):
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

    ServiceLoading.__name__ = ServiceLoading.__qualname__ = f"{service.title()}Loading"
    return ServiceLoading


class Repository(BaseModel):
    """The model repository of a Python stage service."""

    model_dir: Annotated[
        Path,
        model_dir_option(
            "the model repository, in Triton's layout (env PIPELINE_MODEL_DIR; default %(default)s)"
        ),
    ] = DEFAULT_MODEL_DIR


class StageEnsembles(BaseModel):
    """The YAML ensembles a Python stage service reads to know which of the repository's Python models it
    serves (`pipeline.stage.placement`)."""

    ensembles: Annotated[
        list[Path],
        ensembles_option(
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
    ] = DEFAULT_MODEL_DIR


class Runners(BaseModel):
    """How the model service runs its models (`services.model.backend.ModelBackend`)."""

    engine_cache: Annotated[
        Path | None,
        option(
            "--engine-cache",
            env="PIPELINE_ENGINE_CACHE",
            parse=Path,
            help="folder of built TensorRT engines (env PIPELINE_ENGINE_CACHE; default <model-dir>/.engines)",
        ),
    ] = None
    device: Annotated[
        str,
        AfterValidator(device_name),
        option(
            "--device",
            env="PIPELINE_DEVICE",
            parse=device_name,
            help="where instances of kind KIND_AUTO go: auto (a GPU when one is visible, else the CPU), cpu, "
            "cuda or cuda:N (env PIPELINE_DEVICE; default %(default)s)",
        ),
    ] = "auto"
    torch_threads: Annotated[
        int,
        Field(ge=1),
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
        Field(ge=1),
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

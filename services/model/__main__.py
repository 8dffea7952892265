"""`python -m services.model`: serve the ONNX, PyTorch and TensorRT models of a Triton model repository, and
its Python models that ask for GPUs (`instance_group [ { kind: KIND_GPU } ]`)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from pipeline.runtime import settings
from pipeline.runtime.arguments import add_server_arguments, positive_int
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.server import prepare_process
from pipeline.stage.control import add_model_control_arguments
from pipeline.stage.placement import MODEL_SERVICE, model_service_models, python_models_of
from pipeline.stage.python_backend import PythonBackend
from pipeline.stage.service import add_load_model_argument, repository_models, run_stage_service

SERVICE = MODEL_SERVICE
log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared server flags plus this service's own."""
    parser = argparse.ArgumentParser(prog="python -m services.model", description=__doc__)
    add_server_arguments(parser, service=SERVICE)
    add_model_control_arguments(parser)
    parser.add_argument(
        "--model-dir",
        "--model-repository",
        dest="model_dir",
        default=settings.MODEL_DIR.get(),
        help="Triton model repository: <model>/config.pbtxt and <model>/<version>/model.{onnx,pt,pt2,plan}; "
        "the models whose backend is onnxruntime, pytorch or tensorrt are served, and the python models whose "
        "instance_group asks for KIND_GPU (env PIPELINE_MODEL_DIR; default %(default)s)",
    )
    add_load_model_argument(parser, service=SERVICE)
    parser.add_argument(
        "--engine-cache",
        default=settings.ENGINE_CACHE.get(),
        help="folder of built TensorRT engines (env PIPELINE_ENGINE_CACHE; default <model-dir>/.engines)",
    )
    parser.add_argument(
        "--device",
        default=settings.DEVICE.get(),
        help="where instances of kind KIND_AUTO go: auto (a GPU when one is visible, else the CPU), cpu, "
        "cuda or cuda:N (env PIPELINE_DEVICE; default %(default)s)",
    )
    parser.add_argument(
        "--torch-threads",
        "--intra-op-threads",
        dest="torch_threads",
        type=positive_int,
        default=settings.TORCH_THREADS.get(),
        help="intra-op threads of each instance, torch and ONNX Runtime alike, unless its config's "
        "intra_op_thread_count says otherwise; raise only after measuring (env PIPELINE_TORCH_THREADS; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--disable-auto-complete-config",
        action="store_true",
        default=settings.DISABLE_AUTO_COMPLETE_CONFIG.get(),
        help="do not complete configs from the model files: every model needs a config.pbtxt declaring its "
        "inputs, outputs and max_batch_size (env PIPELINE_DISABLE_AUTO_COMPLETE_CONFIG)",
    )
    parser.add_argument(
        "--default-max-batch-size",
        type=positive_int,
        default=settings.DEFAULT_MAX_BATCH_SIZE.get(),
        help="max_batch_size that auto-complete gives a model that batches, as Triton's "
        "default-max-batch-size (env PIPELINE_DEFAULT_MAX_BATCH_SIZE; default %(default)s)",
    )
    parser.add_argument(
        "--strict-runner",
        action="store_true",
        default=settings.STRICT_RUNNER.get(),
        help="fail a model whose first runner cannot build or load it, instead of falling back to the next "
        "(TensorRT, ONNX Runtime CUDA, torch CUDA, CPU); a config's strict_runner parameter says otherwise for "
        "its model (env PIPELINE_STRICT_RUNNER)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and serve until SIGTERM/SIGINT. A model that cannot load is reported
    UNAVAILABLE with its reason (RepositoryIndex, ModelReady, the log); the others serve."""
    from services.model.backend import ModelBackend, ServiceSettings

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = ServiceSettings(
            device=args.device,
            threads=args.torch_threads,
            engine_cache=Path(args.engine_cache) if args.engine_cache else None,
            auto_complete=not args.disable_auto_complete_config,
            default_max_batch_size=args.default_max_batch_size,
            strict_runner=args.strict_runner,
        )
    except ValueError as exc:
        parser.error(str(exc))
    prepare_process(args.log_level, SERVICE)
    repository = ModelRepository(args.model_dir)
    backend = ModelBackend(options, repository_root=repository.root)
    run_stage_service(
        [],
        args,
        service=SERVICE,
        repository=repository,
        backends=[backend, PythonBackend()],
        models=served_models(repository, args),
    )


def served_models(repository: ModelRepository, args: argparse.Namespace) -> list[str]:
    """The models loaded at start-up: those `--load-model` names, else every model of the repository but
    the Python models that run in the Python services (`pipeline.stage.placement`)."""
    named = repository_models(args)
    if named is not None:
        return named
    python = python_models_of(SERVICE, repository, ())
    if python:
        log.info(
            "%s serves the python models %s: their instance_group asks for GPUs (--load-model chooses otherwise)",
            SERVICE,
            ", ".join(python),
        )
    return model_service_models(repository)


if __name__ == "__main__":
    main()

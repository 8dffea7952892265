"""`python -m services.model`: serve the ONNX, PyTorch and TensorRT models of a Triton model repository, and
its Python models that ask for GPUs (`instance_group [ { kind: KIND_GPU } ]`)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from pipeline.runtime import server_settings, service_settings
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.server import prepare_process
from pipeline.runtime.settings_cli import add_arguments
from pipeline.stage.placement import MODEL_SERVICE, model_service_models, python_models_of
from pipeline.stage.python_backend import PythonBackend
from pipeline.stage.service import repository_models, run_stage_service

SERVICE = MODEL_SERVICE
log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared server flags plus this service's own
    (`pipeline.runtime.settings.ModelServiceSettings`)."""
    parser = argparse.ArgumentParser(prog="python -m services.model", description=__doc__)
    add_arguments(parser, service_settings.ModelServiceSettings)
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
    prepare_process(server_settings.log_level_of(args), SERVICE)
    repository = ModelRepository(args.model_dir)
    backend = ModelBackend(options, repository_root=repository.root)
    run_stage_service(
        [],
        args,
        service=SERVICE,
        repository=repository,
        backends=[backend, PythonBackend()],
        models=served_models(repository, args),
        # It runs its own models, loaded at start-up or not (explicit model control), and those named.
        own=sorted({*model_service_models(repository), *(repository_models(args) or ())}),
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

"""`python -m services.model`: serve the ONNX, PyTorch and TensorRT models of a Triton model repository, and
its Python models that ask for GPUs (`instance_group [ { kind: KIND_GPU } ]`)."""

from __future__ import annotations

if __name__ == "__main__":
    from pipeline.runtime.allocator import keep_freed_memory

    keep_freed_memory()  # before the imports below start threads (`pipeline.runtime.allocator`)

import argparse
import logging
from collections.abc import Sequence

from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Loading, ModelServiceSettings, Runners
from pipeline.runtime.service_settings import ModelRepository as ModelRepositorySettings
from pipeline.runtime.settings_cli import add_arguments
from pipeline.stage.placement import MODEL_SERVICE, model_service_models, python_models_of
from pipeline.stage.python_backend import PythonBackend
from pipeline.stage.service import repository_models, run_stage_service

SERVICE = MODEL_SERVICE
log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared server flags plus this service's own
    (`pipeline.runtime.service_settings.ModelServiceSettings`)."""
    parser = argparse.ArgumentParser(prog="python -m services.model", description=__doc__)
    add_arguments(parser, ModelServiceSettings)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and serve until SIGTERM/SIGINT. A model that cannot load is reported
    UNAVAILABLE with its reason (RepositoryIndex, ModelReady, the log); the others serve."""
    from services.model.backend import ModelBackend

    settings = ModelServiceSettings.parse(build_parser(), argv)
    repository = ModelRepository(settings.group(ModelRepositorySettings).model_dir)
    backend = ModelBackend(settings.group(Runners), repository_root=repository.root)
    named = repository_models(settings.group(Loading))
    run_stage_service(
        [],
        settings,
        service=SERVICE,
        repository=repository,
        backends=[backend, PythonBackend()],
        models=served_models(repository, named),
        # It runs its own models, loaded at start-up or not (explicit model control), and those named.
        own=sorted({*model_service_models(repository), *(named or ())}),
    )


def served_models(repository: ModelRepository, named: list[str] | None) -> list[str]:
    """The models loaded at start-up: those `--load-model` names (`named`), else every model of the
    repository but the Python models that run in the Python services (`pipeline.stage.placement`)."""
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

"""`python -m services.model`: serve the model stage models over gRPC."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from services.model.backends import BACKEND_KINDS

SERVICE = "model"
DEFAULT_PORT = 8102


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared server flags plus this service's own."""
    from pipeline.server import add_server_arguments, positive_int

    parser = argparse.ArgumentParser(prog="python -m services.model", description=__doc__)
    add_server_arguments(parser, service=SERVICE, default_port=DEFAULT_PORT)
    parser.add_argument(
        "--model-dir",
        default=os.environ.get("PIPELINE_MODEL_DIR", "models"),
        help="model repository: <model>/config.yaml and <model>/<version>/ folders, e.g. digits_cnn/1/model.pt "
        "(env PIPELINE_MODEL_DIR; default %(default)s)",
    )
    parser.add_argument(
        "--engine-cache",
        default=os.environ.get("PIPELINE_ENGINE_CACHE") or None,
        help="folder of built TensorRT engines (env PIPELINE_ENGINE_CACHE; default <model-dir>/.engines)",
    )
    parser.add_argument(
        "--device",
        default=os.environ.get("PIPELINE_DEVICE", "auto"),
        help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N (env PIPELINE_DEVICE; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--torch-threads",
        type=positive_int,
        default=os.environ.get("PIPELINE_TORCH_THREADS", "1"),
        help="torch intra-op threads; raise only after measuring (env PIPELINE_TORCH_THREADS; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKEND_KINDS,
        default=os.environ.get("PIPELINE_BACKEND", "auto"),
        help="default backend of models whose config.yaml names none: auto (TensorRT on a GPU when it imports, "
        "else torch), torch or tensorrt (env PIPELINE_BACKEND; default %(default)s)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, check the repository, and serve until SIGTERM/SIGINT."""
    from pipeline.server import run_stage_service
    from services.model.backends import BackendUnavailable, resolve_device
    from services.model.plane import RepositoryPlane, ServiceSettings
    from services.model.repository import ModelRepository, RepositoryError, check_repository

    args = build_parser().parse_args(argv)
    repository = ModelRepository(args.model_dir)
    settings = ServiceSettings(
        backend=args.backend,
        device=args.device,
        torch_threads=args.torch_threads,
        engine_cache=args.engine_cache or str(repository.root / ".engines"),
    )
    try:
        resolve_device(args.device)
        check_repository(repository, settings.backend, settings.device)
    except (BackendUnavailable, RepositoryError, ValueError) as exc:
        raise SystemExit(f"services.model: {exc}") from None
    run_stage_service(
        [],
        args,
        service=SERVICE,
        make_plane=lambda telemetry, metrics: RepositoryPlane(
            repository, settings, telemetry=telemetry, metrics=metrics
        ),
    )


if __name__ == "__main__":
    main()

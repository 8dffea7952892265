"""`python -m services.postprocess`: serve the python models (stages) of a model repository over gRPC.

Every `model.py` entry of the repository (`--model-dir`, default `model_repository`) is served: the example
ensembles' postprocess stages live there (`digits_postprocess`, `embeddings_pool`, `refcnn_postprocess`),
and so do yours. `--load-model NAME` serves only those named.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

SERVICE = "postprocess"
DEFAULT_PORT = 8103


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared server flags and the repository's."""
    from pipeline.runtime.arguments import add_server_arguments
    from pipeline.stage.service import add_repository_arguments

    parser = argparse.ArgumentParser(prog="python -m services.postprocess", description=__doc__)
    add_server_arguments(parser, service=SERVICE, default_port=DEFAULT_PORT)
    add_repository_arguments(parser, service=SERVICE)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and serve until SIGTERM/SIGINT."""
    from pipeline.runtime.repository import ModelRepository
    from pipeline.stage.python_backend import PythonBackend
    from pipeline.stage.service import repository_models, run_stage_service

    args = build_parser().parse_args(argv)
    run_stage_service(
        [],
        args,
        service=SERVICE,
        repository=ModelRepository(args.model_dir),
        backends=[PythonBackend()],
        models=repository_models(args),
    )


if __name__ == "__main__":
    main()

"""`python -m services.postprocess`: serve the postprocess stage models over gRPC."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from services.postprocess.classify import ClassifyStage
from services.postprocess.pooling import MeanPoolStage
from services.postprocess.refcnn import RefCNNPostprocess

SERVICE = "postprocess"
DEFAULT_PORT = 8103


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared server flags (this service has none of its own)."""
    from pipeline.server import add_server_arguments

    parser = argparse.ArgumentParser(prog="python -m services.postprocess", description=__doc__)
    add_server_arguments(parser, service=SERVICE, default_port=DEFAULT_PORT)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and serve until SIGTERM/SIGINT."""
    from pipeline.server import run_stage_service

    args = build_parser().parse_args(argv)
    stages = [
        ClassifyStage("digits_postprocess", num_classes=10),
        MeanPoolStage("embeddings_pool", dim=384),
        RefCNNPostprocess(),
    ]
    run_stage_service(stages, args, service=SERVICE)


if __name__ == "__main__":
    main()

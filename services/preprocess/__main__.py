"""`python -m services.preprocess`: serve the preprocess stage models over gRPC."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from services.preprocess.digits import DEFAULT_MAX_IMAGE_PIXELS, DigitsPreprocess
from services.preprocess.refcnn import RefCNNPreprocess
from services.preprocess.text import DEFAULT_MAX_TEXT_BYTES, TextTokenize

SERVICE = "preprocess"
DEFAULT_PORT = 8101


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared server flags plus this service's own."""
    from pipeline.server import add_server_arguments, positive_int

    parser = argparse.ArgumentParser(prog="python -m services.preprocess", description=__doc__)
    add_server_arguments(parser, service=SERVICE, default_port=DEFAULT_PORT)
    parser.add_argument(
        "--max-image-pixels",
        type=positive_int,
        default=os.environ.get("PIPELINE_MAX_IMAGE_PIXELS", str(DEFAULT_MAX_IMAGE_PIXELS)),
        help="refuse images with more pixels (width × height) than this, read from the header before "
        "decoding (env PIPELINE_MAX_IMAGE_PIXELS; default %(default)s)",
    )
    parser.add_argument(
        "--max-text-bytes",
        type=positive_int,
        default=os.environ.get("PIPELINE_MAX_TEXT_BYTES", str(DEFAULT_MAX_TEXT_BYTES)),
        help="refuse sentences longer than this many UTF-8 bytes (env PIPELINE_MAX_TEXT_BYTES; "
        "default %(default)s)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and serve until SIGTERM/SIGINT."""
    from pipeline.server import run_stage_service

    args = build_parser().parse_args(argv)
    stages = [
        DigitsPreprocess(max_image_pixels=args.max_image_pixels),
        TextTokenize(max_text_bytes=args.max_text_bytes),
        RefCNNPreprocess(),
    ]
    run_stage_service(stages, args, service=SERVICE)


if __name__ == "__main__":
    main()

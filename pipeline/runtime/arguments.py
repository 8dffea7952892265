"""The command-line flags every service shares, and the argparse types they use."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from pipeline.runtime.metrics import metrics_port
from pipeline.runtime.security import (
    add_auth_arguments,
    add_tls_arguments,
)

log = logging.getLogger(__name__)


def positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def add_server_arguments(
    parser: argparse.ArgumentParser,
    *,
    service: str,
    default_port: int,
    default_metrics_port: int | None = None,
) -> None:
    """Flags every service takes; each defaults from a `PIPELINE_...` environment variable.

    The metrics port defaults to `default_metrics_port`, else the service's port plus 100 (8101 -> 8201).
    """
    env = service.upper()
    if default_metrics_port is None:
        default_metrics_port = default_port + 100
    parser.add_argument(
        "--host",
        default=os.environ.get("PIPELINE_HOST", "127.0.0.1"),
        help="address to listen on (env PIPELINE_HOST; 0.0.0.0 in containers)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get(f"PIPELINE_{env}_PORT", default_port)),
        help=f"port to listen on, 0 for one the OS picks (env PIPELINE_{env}_PORT)",
    )
    parser.add_argument(
        "--port-file", type=Path, default=None, help="write the bound port to this file once listening"
    )
    parser.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=metrics_port(os.environ.get(f"PIPELINE_{env}_METRICS_PORT", str(default_metrics_port))),
        help=f"port of the Prometheus /metrics endpoint, 0 for one the OS picks, 'off' or negative for none "
        f"(env PIPELINE_{env}_METRICS_PORT; default %(default)s)",
    )
    parser.add_argument(
        "--metrics-port-file", type=Path, default=None, help="write the bound metrics port to this file"
    )
    parser.add_argument(
        "--max-message-mb",
        type=positive_int,
        default=int(os.environ.get("PIPELINE_MAX_MESSAGE_MB", 64)),
        help="largest gRPC message accepted or sent, in MiB (env PIPELINE_MAX_MESSAGE_MB)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=float(os.environ.get("PIPELINE_GRACE_PERIOD", 10.0)),
        help="seconds in-flight requests get to finish on SIGTERM (env PIPELINE_GRACE_PERIOD)",
    )
    parser.add_argument(
        "--drain-delay",
        type=float,
        default=float(os.environ.get("PIPELINE_DRAIN_DELAY", 1.0)),
        help="seconds a stopping server keeps serving while reporting NOT_SERVING, so that clients move "
        "to other replicas first (env PIPELINE_DRAIN_DELAY)",
    )
    add_tls_arguments(parser)
    add_auth_arguments(parser, router=service == "router")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("PIPELINE_LOG_LEVEL", "INFO"),
        help="logging level (env PIPELINE_LOG_LEVEL)",
    )


def bytes_argument(value: str) -> int:
    """An argparse type: a number of bytes, with an optional k, M or G suffix (powers of 1024)."""
    text = value.strip()
    scale = {"k": 1024, "m": 1024**2, "g": 1024**3}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes such as 1048576 or 64M, got {value!r}"
        ) from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"a size cannot be negative, got {value!r}")
    return size

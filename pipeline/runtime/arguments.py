"""The command-line flags every service shares, and the argparse types they use."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pipeline.runtime import settings
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


def non_negative_int(value: str) -> int:
    """An argparse type: an integer of at least 0."""
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {number}")
    return number


def inflight_bytes_of(args: argparse.Namespace) -> int | None:
    """`--max-inflight-mb` in bytes; None where it is 0 (no limit)."""
    mib = getattr(args, "max_inflight_mb", settings.MAX_INFLIGHT_MB.get())
    return mib * 1024 * 1024 if mib else None


def add_server_arguments(
    parser: argparse.ArgumentParser,
    *,
    service: str,
) -> None:
    """Flags every service takes; each defaults from its `PIPELINE_...` variable (`pipeline.runtime.settings`)."""
    env = service.upper()
    parser.add_argument(
        "--host",
        default=settings.HOST.get(),
        help="address to listen on (env PIPELINE_HOST; 0.0.0.0 in containers)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=settings.port(service).get(),
        help=f"port to listen on, 0 for one the OS picks (env PIPELINE_{env}_PORT)",
    )
    parser.add_argument(
        "--port-file", type=Path, default=None, help="write the bound port to this file once listening"
    )
    parser.add_argument(
        "--metrics-port",
        type=settings.port_or_off,
        default=settings.metrics_port(service).get(),
        help=f"port of the Prometheus /metrics endpoint, 0 for one the OS picks, 'off' or negative for none "
        f"(env PIPELINE_{env}_METRICS_PORT; default %(default)s)",
    )
    parser.add_argument(
        "--metrics-port-file", type=Path, default=None, help="write the bound metrics port to this file"
    )
    frames = settings.frames_port(service)
    fast_path = (
        "the stages' fast path for their models' calls to other models (BLS)"
        if service == "router"
        else "the router's fast path to this service"
    )
    parser.add_argument(
        "--frames-port",
        type=settings.port_or_off,
        default=frames.get(),
        help=f"port of the frame protocol, {fast_path} (the protocol's messages on a stream of their own, "
        "with the TLS and client certificates of the gRPC port where it has them; gRPC serves everything "
        f"else), 0 for one the OS picks, 'off' for none (env {frames.variable}; default %(default)s)",
    )
    if service != "router":
        parser.add_argument(
            "--router",
            default=settings.ROUTER.get(),
            metavar="HOST:PORT",
            help="the router, where the calls that models make to other models go (Triton's BLS: "
            "InferenceRequest.exec); without it such calls are answered with an error (env PIPELINE_ROUTER)",
        )
        parser.add_argument(
            "--router-port-file",
            type=Path,
            default=None,
            help="read the router's port from this file (its --port-file) at the first call a model makes, "
            "for a router started after this service on a port the OS picks",
        )
    parser.add_argument(
        "--max-message-mb",
        type=positive_int,
        default=settings.MAX_MESSAGE_MB.get(),
        help="largest gRPC message accepted or sent, in MiB (env PIPELINE_MAX_MESSAGE_MB)",
    )
    parser.add_argument(
        "--max-inflight-mb",
        type=non_negative_int,
        default=settings.MAX_INFLIGHT_MB.get(),
        help="MiB of requests and responses held in flight at once: a unary request past it is refused "
        "with UNAVAILABLE, a stream is not read further until it fits; 0 for no limit "
        "(env PIPELINE_MAX_INFLIGHT_MB; default %(default)s)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=settings.GRACE_PERIOD.get(),
        help="seconds in-flight requests get to finish on SIGTERM (env PIPELINE_GRACE_PERIOD)",
    )
    parser.add_argument(
        "--drain-delay",
        type=float,
        default=settings.DRAIN_DELAY.get(),
        help="seconds a stopping server keeps serving while reporting NOT_SERVING, so that clients move "
        "to other replicas first (env PIPELINE_DRAIN_DELAY)",
    )
    add_tls_arguments(parser)
    add_auth_arguments(parser, router=service == "router")
    parser.add_argument(
        "--log-level",
        default=settings.LOG_LEVEL.get(),
        help="logging level (env PIPELINE_LOG_LEVEL)",
    )

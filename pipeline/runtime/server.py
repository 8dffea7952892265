"""The gRPC server every service stands on: the protocol servicer (`pipeline.runtime.servicer`), health and
reflection, with the channel options servers and clients share, and what a server process does first and
once it is up. Its life (start, serve, drain, stop) is `pipeline.runtime.lifecycle`'s.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.server_settings import Listening
from pipeline.runtime.servicer import InferenceServicer
from pipeline.runtime.settings_values import DEFAULT_MAX_CONNECTION_AGE_S
from pipeline.runtime.shutdown import (
    die_with_parent,
)

log = logging.getLogger(__name__)


#: The service whose health status says whether models can be served.
INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel options for servers and clients: bounded message sizes above gRPC's 4 MiB default."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


#: How long calls still open on a recycled connection (streams: the router's health watches) may go on.
MAX_CONNECTION_AGE_GRACE_MS = 60_000

#: A client's keepalive: a ping every this long, and the connection closed when one is not answered within
#: `KEEPALIVE_TIMEOUT_MS`. A hung server (stopped, or spinning without its network thread) keeps its TCP
#: connections open and its kernel acknowledges every packet: only an unanswered ping tells.
KEEPALIVE_TIME_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 2_000
#: The shortest interval between a client's pings that a server accepts when no data flows (the router's
#: health watches send none for as long as nothing changes); gRPC's default, 5 minutes, would answer the
#: router's pings as abuse (GOAWAY "too_many_pings").
MIN_PING_INTERVAL_MS = 1_000


def keepalive_options() -> list[tuple[str, int]]:
    """Channel options of a client that must notice a hung server within seconds: keepalive pings, sent
    whether or not calls are open and however long no data flowed, that every server of ours accepts
    (`create_server`). A server that accepts pings no more often than every 5 minutes (Triton's default)
    closes the connection after two; gRPC's client then doubles its interval, so that pings slow down to
    what such a server allows."""
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # What gRPC's transport enforces today: an unanswered ping (keepalive or not) closes it after this.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class _Handlers:
    """Takes the method handlers the generated code registers, so that one may be replaced first."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # made again from the registered ones

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.service, self.handlers = service, dict(handlers)


#: The methods registered with gRPC's server ahead of calls (the others are found by name as they come):
#: grpc.aio's server waits on one task per registered method to take each call, so every method registered
#: costs every call (8% of a bare server's CPU per call with the service's fourteen methods).
_REGISTERED = ("ModelInfer", "ModelStreamInfer")


def _add_inference_service(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """`inference.GRPCInferenceService` as generated, but for `ModelInfer`'s handler: one that reads its
    request itself (a client-streaming handler: the client's unary call is one message on the same HTTP/2
    stream), so that a request past the budget of bytes in flight is refused before its message is read."""
    caught = _Handlers()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, caught)
    caught.handlers["ModelInfer"] = grpc.stream_unary_rpc_method_handler(
        servicer.ModelInferWithinBudget, response_serializer=pb.ModelInferResponse.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(caught.service, caught.handlers),))
    server.add_registered_method_handlers(
        caught.service, {name: caught.handlers[name] for name in _REGISTERED}
    )


async def create_server(
    address: str,
    servicer: InferenceServicer,
    health_servicer: health.aio.HealthServicer,
    *,
    max_message_bytes: int = 64 * 1024 * 1024,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    reuse_port: bool = False,
    max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S,
) -> tuple[grpc.aio.Server, int]:
    """An aio server (not started) with inference, health and reflection; returns it and its bound port.

    With `credentials` it listens with TLS only; `interceptors` (e.g. authentication) see every call;
    `reuse_port` shares the port with other processes that ask for it too (`SO_REUSEPORT`); clients'
    connections are recycled after `max_connection_age_s`."""
    options = [
        *server_options(max_message_bytes),
        ("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
        # In-flight calls on a recycled connection get this long to finish.
        ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
        # The router's keepalive pings (`keepalive_options`) are welcome, with calls open or not.
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if reuse_port:
        options.append(("grpc.so_reuseport", 1))
    server = grpc.aio.server(options=options, interceptors=list(interceptors) or None)
    _add_inference_service(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            INFERENCE_SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return server, port


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    """Report the server (and its inference service) SERVING or NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", INFERENCE_SERVICE):
        await health_servicer.set(service, status)


def prepare_process(level: str, service: str) -> None:
    """What every service process does first: its log format and its end with the launcher that started it
    (`pipeline.runtime.shutdown.die_with_parent`). Its allocator's settings come before, at its entry point
    (`pipeline.runtime.allocator.keep_freed_memory`)."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )
    die_with_parent()


def settle_garbage_collection() -> None:
    """Once a server is up: move what start-up built (modules, models, plans) out of the collector's sight
    and collect the young generation less often. A request makes thousands of short-lived objects, and the
    default thresholds had the collector walk the long-lived ones over and over (4% of a loaded router's CPU,
    in a profile)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])


#: Allocations between collections of the youngest generation once a server is up (Python's default: 700).
GC_THRESHOLD = 20_000


def write_port(path: Path | None, port: int) -> None:
    """Write the bound port atomically, for launchers and tests that asked for port 0."""
    if path is None:
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


def start_metrics(metrics: Metrics, listening: Listening) -> int | None:
    """Serve `metrics` where `--metrics-port` says (none where it is off)."""
    port = metrics.serve(listening.host, listening.metrics_port)
    if port is not None:
        write_port(listening.metrics_port_file, port)
    return port

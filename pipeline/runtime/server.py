"""The server runtime every service stands on: the protocol servicer, health, reflection and shutdown.

A servicer is thin: it hands each RPC to a `DataPlane` (a stage service's or the router's) and maps the
`PipelineError`s the plane raises to gRPC status codes, in one place.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

import pipeline
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.codec import Tensor, infer_response
from pipeline.protocol.datatypes import DATATYPES, datatype_of
from pipeline.protocol.errors import (
    ERROR_DOMAIN,
    NOT_STARTED,
    ModelNotFound,
    PipelineError,
    Unavailable,
    Unimplemented,
)
from pipeline.runtime.metrics import Metrics, metrics_port
from pipeline.runtime.security import (
    SecurityConfigError,
    access_policy_of,
    add_auth_arguments,
    add_tls_arguments,
    interceptors_of,
    server_credentials_of,
)
from pipeline.runtime.telemetry import MODEL, NO_SPAN, REQUEST_ID, Telemetry, record_error
from pipeline.stage.api import Stage, TensorSpec

if TYPE_CHECKING:
    from pipeline.runtime.repository import ModelRepository
    from pipeline.stage.backend import Backend

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The service whose health status says whether models can be served.
INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name

#: Metadata keys that belong to one hop and are not passed on to the next. The client's credentials are
#: the router's to check; the router calls its stages with credentials of its own (its stage token or its
#: client certificate), so a client's token never travels further.
_HOP_HEADERS = frozenset(
    {"user-agent", "content-type", "te", "grpc-timeout", "grpc-encoding", "host", "authorization"}
)


@dataclass(frozen=True, slots=True)
class CallContext:
    """What the data plane needs of the incoming call: its time left and the client's metadata."""

    timeout: float | None
    metadata: tuple[tuple[str, str | bytes], ...]

    @classmethod
    def of(cls, context: grpc.aio.ServicerContext) -> CallContext:
        metadata = tuple(
            (key, value)
            for key, value in (context.invocation_metadata() or ())
            if not key.startswith(":") and key not in _HOP_HEADERS
        )
        return cls(context.time_remaining(), metadata)


class DataPlane(abc.ABC):
    """What a server does, free of gRPC types: model lookup, metadata, configuration and inference."""

    #: `ServerMetadata.extensions`: the protocol extensions this server supports.
    extensions: tuple[str, ...] = ("model_configuration", "statistics")

    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether every model is ready to serve."""

    @abc.abstractmethod
    async def model_ready(self, name: str, version: str) -> bool:
        """Whether a model (at a version, or its default one) is ready."""

    @abc.abstractmethod
    async def model_metadata(self, name: str, version: str, call: CallContext) -> pb.ModelMetadataResponse:
        """`ModelMetadata` of a model; raises `ModelNotFound`."""

    @abc.abstractmethod
    async def model_config(self, name: str, version: str, call: CallContext) -> mc.ModelConfig:
        """Triton's `ModelConfig` of a model; raises `ModelNotFound`."""

    @abc.abstractmethod
    async def infer(self, request: pb.ModelInferRequest, call: CallContext) -> pb.ModelInferResponse:
        """Run one inference request."""

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        """Triton's `ModelStatistics`: every model's counters, or one model's (`name`)."""
        raise Unimplemented("this server keeps no statistics")

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        """Triton's `RepositoryIndex`: every model (version) in the repository and its state."""
        raise Unimplemented("this server has no model repository")

    async def repository_load(self, name: str, parameters: Mapping[str, object]) -> None:
        """Triton's `RepositoryModelLoad`: load or reload a model."""
        raise Unimplemented("this server has no model repository")

    async def repository_unload(self, name: str, parameters: Mapping[str, object]) -> None:
        """Triton's `RepositoryModelUnload`: stop serving a model."""
        raise Unimplemented("this server has no model repository")


async def _guarded(context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
    """Await `work`, turning a `PipelineError` into its status and anything else into INTERNAL."""
    try:
        return await work
    except PipelineError as err:
        await context.abort(err.code, err.message, trailing_metadata=status_details(err))
    except grpc.aio.AbortError:
        raise
    except Exception:
        await context.abort(grpc.StatusCode.INTERNAL, internal_error())
    raise AssertionError("unreachable: abort raises")


def status_details(err: PipelineError) -> tuple[tuple[str, bytes], ...]:
    """The `google.rpc.Status` details of an error, as trailing metadata (grpcio-status): a `BadRequest`
    field violation `TENSOR[i]` per refused item, and `ErrorInfo` NOT_STARTED on an UNAVAILABLE (the call was
    refused before it started, so a client may send it to another replica)."""
    details = []
    if err.items:
        bad = error_details_pb2.BadRequest()
        for item in err.items:
            bad.field_violations.add(field=item.field, description=item.description)
        details.append(bad)
    if isinstance(err, Unavailable):
        details.append(error_details_pb2.ErrorInfo(reason=NOT_STARTED, domain=ERROR_DOMAIN))
    if not details:
        return ()
    status = status_pb2.Status(code=err.code.value[0], message=err.message)
    for detail in details:
        status.details.add().Pack(detail)
    return tuple(rpc_status.to_status(status).trailing_metadata)


def internal_error() -> str:
    """Log the exception being handled under a new incident id; return what the client is told instead."""
    incident = uuid.uuid4().hex[:12]
    log.exception("internal error, incident %s", incident)
    return f"internal error (incident {incident} in the server log)"


def outcome_of(err: BaseException) -> str:
    """The gRPC status code name a request that raised `err` is answered with."""
    if isinstance(err, PipelineError):
        return err.code.name
    if isinstance(err, asyncio.CancelledError):
        return "CANCELLED"
    return "INTERNAL"


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """`inference.GRPCInferenceService` over a `DataPlane`, with a span and metrics for each inference."""

    def __init__(
        self,
        plane: DataPlane,
        name: str,
        *,
        telemetry: Telemetry | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.plane = plane
        self.name = name
        self.telemetry = telemetry or Telemetry()
        self.metrics = metrics or Metrics()
        # Triton's nv_inference_* metrics: read from the same statistics ModelStatistics answers with.
        self.metrics.export_statistics(plane.statistics)

    async def infer(self, request: pb.ModelInferRequest, call: CallContext) -> pb.ModelInferResponse:
        """One inference through the plane: the request's server span (continuing the caller's trace)
        and its count and latency. Every front door (gRPC here, HTTP in `pipeline.rest`) infers through
        this one path."""
        model = request.model_name
        started = time.perf_counter()
        outcome = "OK"
        telemetry = self.telemetry
        span_scope = (
            telemetry.server_span(
                f"ModelInfer {model}", call.metadata, {MODEL: model, REQUEST_ID: request.id}
            )
            if telemetry.enabled
            else NO_SPAN
        )
        with span_scope as span:
            try:
                return await self.plane.infer(request, call)
            except BaseException as err:
                outcome = outcome_of(err)
                if isinstance(err, ModelNotFound):
                    model = ""  # a client's made-up names must not become label values
                if span is not None and outcome != "CANCELLED":
                    record_error(span, err, outcome)
                raise
            finally:
                self.metrics.requests.labels(model, outcome).inc()
                if outcome == "OK":
                    self.metrics.request_duration.labels(model).observe(time.perf_counter() - started)

    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext):
        return pb.ServerReadyResponse(ready=self.plane.ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext):
        ready = await _guarded(context, self.plane.model_ready(request.name, request.version))
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext):
        return pb.ServerMetadataResponse(
            name=self.name, version=pipeline.__version__, extensions=self.plane.extensions
        )

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext):
        call = CallContext.of(context)
        return await _guarded(context, self.plane.model_metadata(request.name, request.version, call))

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext):
        call = CallContext.of(context)
        config = await _guarded(context, self.plane.model_config(request.name, request.version, call))
        return pb.ModelConfigResponse(config=config)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext):
        return await _guarded(context, self.infer(request, CallContext.of(context)))

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext):
        return await _guarded(context, self.plane.statistics(request.name, request.version))

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext):
        return await _guarded(context, self.plane.repository_index(request.ready))

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ):
        params = {
            k: getattr(v, v.WhichOneof("parameter_choice") or "string_param")
            for k, v in request.parameters.items()
        }
        await _guarded(context, self.plane.repository_load(request.model_name, params))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ):
        params = {
            k: getattr(v, v.WhichOneof("parameter_choice") or "string_param")
            for k, v in request.parameters.items()
        }
        await _guarded(context, self.plane.repository_unload(request.model_name, params))
        return pb.RepositoryModelUnloadResponse()

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests on a stream run concurrently; each response (or error) is sent as it completes."""
        call = CallContext.of(context)
        done: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def one(request: pb.ModelInferRequest) -> None:
            try:
                response = await self.infer(request, call)
                await done.put(pb.ModelStreamInferResponse(infer_response=response))
            except PipelineError as err:
                failed = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
                await done.put(pb.ModelStreamInferResponse(error_message=err.message, infer_response=failed))
            except Exception:
                log.exception("internal error in a streamed request")
                await done.put(pb.ModelStreamInferResponse(error_message="internal error"))

        async def read() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks))
            await done.put(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await done.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()


def stage_response(
    model: str,
    version: str,
    request_id: str,
    wanted: Sequence[str],
    result: dict[str, np.ndarray],
    specs: Mapping[str, TensorSpec],
    batch: int | None,
) -> pb.ModelInferResponse:
    """Check a stage's result against its declared outputs and build the response."""
    tensors = []
    for name in wanted:
        if name not in result:
            raise RuntimeError(f"model '{model}' returned no output '{name}'")
        array = np.asarray(result[name])
        spec = specs[name]
        if datatype_of(array) != spec.datatype and spec.datatype != "BYTES":
            array = array.astype(DATATYPES[spec.datatype])
        if batch is not None and (array.ndim == 0 or array.shape[0] != batch):
            raise RuntimeError(
                f"model '{model}' output '{name}' has shape {list(array.shape)}, expected batch {batch}"
            )
        tensors.append(Tensor.from_array(name, array))
    return infer_response(model, version, request_id, tensors)


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel options for servers and clients: bounded message sizes above gRPC's 4 MiB default."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


#: Clients reconnect after this long, and so look the server's name up again: a router whose stage
#: address is a DNS name then finds replicas that started after it connected.
MAX_CONNECTION_AGE_MS = int(float(os.environ.get("PIPELINE_MAX_CONNECTION_AGE_S", "30")) * 1000)
#: How long calls still open on a recycled connection (streams: the router's health watches) may go on.
MAX_CONNECTION_AGE_GRACE_MS = 60_000


async def create_server(
    address: str,
    servicer: InferenceServicer,
    health_servicer: health.aio.HealthServicer,
    *,
    max_message_bytes: int = 64 * 1024 * 1024,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, int]:
    """An aio server (not started) with inference, health and reflection; returns it and its bound port.

    With `credentials` it listens with TLS only; `interceptors` (e.g. authentication) see every call;
    `reuse_port` shares the port with other processes that ask for it too (`SO_REUSEPORT`)."""
    options = [
        *server_options(max_message_bytes),
        ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
        # In-flight calls on a recycled connection get this long to finish.
        ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
    ]
    if reuse_port:
        options.append(("grpc.so_reuseport", 1))
    server = grpc.aio.server(options=options, interceptors=list(interceptors) or None)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
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


def add_repository_arguments(parser: argparse.ArgumentParser, *, service: str) -> None:
    """The model repository flags, in Triton's spelling too: `--model-dir` (alias `--model-repository`, env
    `PIPELINE_MODEL_DIR`) and `--load-model NAME` (repeatable; env `PIPELINE_<SERVICE>_LOAD_MODEL`, names
    separated by commas), which serves only the models named instead of every one the service runs."""
    env = f"PIPELINE_{service.upper()}_LOAD_MODEL"
    parser.add_argument(
        "--model-dir",
        "--model-repository",
        dest="model_dir",
        type=Path,
        default=Path(os.environ.get("PIPELINE_MODEL_DIR", "model_repository")),
        help="the model repository, in Triton's layout (env PIPELINE_MODEL_DIR; default %(default)s)",
    )
    parser.add_argument(
        "--load-model",
        action="append",
        metavar="NAME",
        default=None,
        help=f"serve only this repository model (repeatable; env {env}, comma-separated); without it, "
        "every model of the repository that this service runs",
    )
    parser.set_defaults(load_model_env=[n for n in os.environ.get(env, "").split(",") if n.strip()])


def repository_models(args: argparse.Namespace) -> list[str] | None:
    """The models `--load-model` (or its environment variable) names, or None for all of them."""
    names = args.load_model if args.load_model is not None else args.load_model_env
    return [name.strip() for name in names] or None


def configure_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )


async def serve(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    *,
    grace: float,
    start: Callable[[], Coroutine[Any, Any, None]] | None = None,
    stop: Callable[[], Awaitable[None]] | None = None,
    stopping: asyncio.Event | None = None,
    drain_delay: float = 0.0,
) -> None:
    """Run a server until `stopping` is set (by default: SIGTERM or SIGINT), then drain.

    Draining reports NOT_SERVING first and keeps serving for `drain_delay` seconds, so that clients that
    watch health (the router does) move to other replicas before any call is refused; then it
    refuses new RPCs and gives in-flight ones `grace` seconds.
    """
    loop = asyncio.get_running_loop()
    signals: tuple[signal.Signals, ...] = ()
    if stopping is None:
        stopping = asyncio.Event()
        signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stopping.set)
    await server.start()
    try:
        if start is not None:
            starting = asyncio.create_task(start())
            waiting = asyncio.create_task(stopping.wait())
            await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
            else:
                waiting.cancel()
                starting.result()
        await stopping.wait()
    finally:
        log.info("shutting down: draining in-flight requests (grace %.1fs)", grace)
        await health_servicer.enter_graceful_shutdown()
        if drain_delay > 0:
            await asyncio.sleep(drain_delay)
        await server.stop(grace)
        if stop is not None:
            await stop()
        for sig in signals:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


def write_port(path: Path | None, port: int) -> None:
    """Write the bound port atomically, for launchers and tests that asked for port 0."""
    if path is None:
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


def start_metrics(metrics: Metrics, args: argparse.Namespace) -> int | None:
    """Serve `metrics` where `--metrics-port` says (in-process servers without the flag serve none)."""
    port = metrics.serve(args.host, getattr(args, "metrics_port", None))
    if port is not None:
        write_port(getattr(args, "metrics_port_file", None), port)
    return port


async def serve_stages(
    stages: Sequence[Stage],
    args: argparse.Namespace,
    *,
    service: str,
    stopping: asyncio.Event | None = None,
    bound: Callable[[int], None] | None = None,
    telemetry: Telemetry | None = None,
    metrics: Metrics | None = None,
    repository: ModelRepository | None = None,
    backends: Sequence[Backend] = (),
    models: Sequence[str] | None = None,
) -> None:
    """Serve stage models until a signal (or `stopping`): listen first, load the models, then SERVING.

    The models are the `stages` objects, and the entries of `repository` whose backend is one of
    `backends` (`models`: only those named). `bound` is called with the port once the server listens
    (tests and launchers ask for port 0). `telemetry` defaults to tracing configured by the environment
    (`Telemetry.from_env`), `metrics` to a registry of this server's own.
    """
    from pipeline.stage.plane import StagePlane

    owned = telemetry is None
    telemetry = Telemetry.from_env(service) if telemetry is None else telemetry
    metrics = Metrics() if metrics is None else metrics
    plane = StagePlane(
        stages, repository=repository, backends=backends, models=models, telemetry=telemetry, metrics=metrics
    )
    health_servicer = health.aio.HealthServicer()
    await set_serving(health_servicer, False)
    server, port = await create_server(
        f"{args.host}:{args.port}",
        InferenceServicer(plane, service, telemetry=telemetry, metrics=metrics),
        health_servicer,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        credentials=server_credentials_of(args),
        interceptors=interceptors_of(access_policy_of(args, stage=True)),
    )

    async def start() -> None:
        start_metrics(metrics, args)
        write_port(args.port_file, port)
        if bound is not None:
            bound(port)
        source = f" and the repository {repository.root}" if repository is not None else ""
        log.info("%s listening on %s:%d, loading its models%s", service, args.host, port, source)
        await plane.load()
        await set_serving(health_servicer, True)
        log.info(
            "%s serving %s on %s:%d", service, ", ".join(plane.model_names) or "no model", args.host, port
        )

    async def stop() -> None:
        await plane.unload()
        metrics.close()
        if owned:
            # Flushing may wait on an exporter's endpoint: not on the event loop.
            await asyncio.to_thread(telemetry.shutdown)

    await serve(
        server,
        health_servicer,
        grace=args.grace_period,
        start=start,
        stop=stop,
        stopping=stopping,
        drain_delay=getattr(args, "drain_delay", 0.0),
    )


def run_stage_service(
    stages: Sequence[Stage],
    args: argparse.Namespace,
    *,
    service: str,
    repository: ModelRepository | None = None,
    backends: Sequence[Backend] = (),
    models: Sequence[str] | None = None,
) -> None:
    """Entry point of a stage service process: serve `stages` and the repository models of `backends` until
    SIGTERM or SIGINT."""
    configure_logging(args.log_level, service)
    try:
        asyncio.run(
            serve_stages(
                stages, args, service=service, repository=repository, backends=backends, models=models
            )
        )
    except SecurityConfigError as err:
        log.error("%s", err)
        raise SystemExit(2) from None

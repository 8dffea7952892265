"""The Open Inference Protocol's HTTP/REST side, served by the router beside gRPC.

aiohttp serves it on the router's own asyncio loop. The handlers only translate: JSON (and Triton's binary
tensor data extension) in, a `pb.ModelInferRequest` or a plane call out, and back. Inference goes through
the server's `InferenceHandler` (`pipeline.runtime.handler`), as gRPC's and the frame port's do, so every
door shares one path: the same budget of bytes in flight, access policy, spans, metrics, validation, errors,
batching and statistics. A `PipelineError`'s gRPC status is
mapped once to an HTTP status (`HTTP_STATUS`) with a `{"error": "..."}` body.

Triton's generate extension: `POST .../generate` takes one JSON object and answers one, and
`.../generate_stream` answers with Server-Sent Events, one `data: {...}` event per response of a decoupled
model or ensemble (an error in one of them as `data: {"error": "..."}`); a request refused before its first
response gets the usual JSON error and status.

The bodies' JSON and Triton's binary tensor data are `pipeline.router.frontdoor.rest_codec`'s; large bodies and
responses are decoded and encoded off the event loop, which gRPC shares (`pipeline.router.frontdoor.codec_pool`).
Request bodies may be gzip- or deflate-compressed (`Content-Encoding`, decompressed within the size limit);
responses are compressed when the client's `Accept-Encoding` asks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

import pipeline
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import InvalidInput, PipelineError, StageError
from pipeline.protocol.proto_json import message_json
from pipeline.protocol.streams import is_final, status_of
from pipeline.router.frontdoor.codec_pool import CodecPool
from pipeline.router.frontdoor.rest_codec import (
    HEADER_LENGTH,
    BodyTooLarge,
    body_too_large,
    check_encoding,
    decompressed,
    generate_request,
    generate_response,
    json_field,
    metadata_json,
)
from pipeline.router.frontdoor.torchserve_api import OPEN_PATHS as TS_OPEN_PATHS
from pipeline.router.frontdoor.torchserve_api import TorchServeApi
from pipeline.runtime.admission import REQUEST_COST, cost_of
from pipeline.runtime.data_plane import RequestContext
from pipeline.runtime.error_status import internal_error
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.router_settings import Http
from pipeline.runtime.security import (
    UNAUTHENTICATED_MESSAGE,
    Scope,
    certificate_names,
    server_ssl_context_of,
)
from pipeline.runtime.server import write_port
from pipeline.runtime.server_settings import Listening, Security
from pipeline.runtime.settings_cli import ProcessSettings

log = logging.getLogger(__name__)

#: A `PipelineError`'s gRPC status as an HTTP status. RESOURCE_EXHAUSTED raised by a plane is a quota
#: (429); a body over the size limit is refused by the HTTP server itself, with 413.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNAUTHENTICATED: 401,
}

#: Request headers passed on to the stages: the W3C trace context, which the plane continues. Other HTTP
#: headers are not gRPC metadata and stay at this hop.
_FORWARDED_HEADERS = ("traceparent", "tracestate")

#: Paths anyone may call: liveness and readiness probes need no token (as on the gRPC side).
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})

#: Route names that change what is served: they need the admin scope.
_ADMIN_ROUTES = frozenset({"repository_load", "repository_unload"})


def error_response(status: int, message: str) -> web.Response:
    """The protocol's error answer: an HTTP status and `{"error": message}`."""
    return web.json_response({"error": message}, status=status)


# --- the application -----------------------------------------------------------------------------------


class RestFrontDoor:
    """The REST endpoints over a server's `InferenceHandler` and its data plane (`handler.plane`)."""

    def __init__(
        self,
        handler: InferenceHandler,
        *,
        max_body_bytes: int = 64 * 1024 * 1024,
        max_json_output_bytes: int = 64 * 1024 * 1024,
        codec: CodecPool | None = None,
        torchserve: TorchServeApi | None = None,
    ) -> None:
        """`max_body_bytes`: the largest request body, decompressed, and the most its inputs may hold;
        `max_json_output_bytes`: the largest JSON a response's outputs may take (0: no limit; binary data
        has none); `codec`: where large bodies and responses are decoded and encoded; `torchserve`:
        TorchServe's inference and management APIs beside the protocol's. Who may call what is the
        handler's access policy, as on the gRPC side (bearer tokens, and client certificates where the
        server requires them)."""
        self.handler = handler
        self.torchserve = torchserve
        self.plane = handler.plane
        self.policy = handler.policy
        self.max_body_bytes = max_body_bytes
        self.max_json_output_bytes = max_json_output_bytes
        self.codec = codec or CodecPool()

    def app(self) -> web.Application:
        """The aiohttp application: every endpoint, error mapping, then authentication."""
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors, self._auth])
        get, post = web.get, web.post
        model = "/v2/models/{model}"
        versioned = "/v2/models/{model}/versions/{version}"
        routes = [
            get("/v2/health/live", self.live),
            get("/v2/health/ready", self.ready),
            get("/v2", self.server_metadata),
            get("/v2/models/stats", self.statistics),
            post("/v2/repository/index", self.repository_index),
            post("/v2/repository/models/{model}/load", self.repository_load, name="repository_load"),
            post("/v2/repository/models/{model}/unload", self.repository_unload, name="repository_unload"),
        ]
        for base in (model, versioned):
            routes += [
                get(base, self.model_metadata),
                get(base + "/ready", self.model_ready),
                get(base + "/config", self.model_config),
                get(base + "/stats", self.statistics),
                post(base + "/infer", self.infer),
                post(base + "/generate", self.generate),
                post(base + "/generate_stream", self.generate_stream),
            ]
        if self.torchserve is not None:
            routes += self.torchserve.routes()
        app.add_routes(routes)
        return app

    # --- middleware ------------------------------------------------------------------------------------

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every failure as the protocol's error answer: a status and `{"error": ...}`."""
        try:
            return await handler(request)
        except BodyTooLarge as err:
            response = error_response(413, err.message)
        except PipelineError as err:
            response = error_response(HTTP_STATUS.get(err.code, 500), err.message)
        except web.HTTPRequestEntityTooLarge:
            response = error_response(413, body_too_large(self.max_body_bytes))
        except web.HTTPException as err:  # aiohttp's own answers: unknown path, wrong method, ...
            if err.status < 400:
                raise
            response = error_response(err.status, f"{err.reason}: {request.method} {request.path}")
        except Exception:
            response = error_response(500, internal_error())
        if not request.content.is_eof():
            # The body was refused before its end (too large, not decompressible): the connection cannot
            # carry another request, and the client must know not to send one on it.
            response.force_close()
        return response

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Credentials as on the gRPC side (a bearer token, or the connection's client certificate): health
        stays open, repository changes need the admin scope."""
        policy = self.policy
        if (
            not policy.enabled
            or request.path in OPEN_PATHS
            or (self.torchserve is not None and request.path in TS_OPEN_PATHS)
            or request.match_info.http_exception is not None  # no such endpoint: 404 or 405 as it is
        ):
            return await handler(request)
        header = request.headers.get("Authorization")
        metadata = (("authorization", header),) if header is not None else ()
        transport = request.transport
        names = certificate_names(transport.get_extra_info("peercert")) if transport is not None else ()
        scope = policy.scope(metadata, names)
        if scope is None:
            response = error_response(401, UNAUTHENTICATED_MESSAGE)
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        route = request.match_info.route.name
        if (route in _ADMIN_ROUTES or TorchServeApi.is_admin_route(route)) and scope < Scope.ADMIN:
            return error_response(
                403,
                "changing the model repository needs an admin token (or a client certificate listed in "
                "--tls-admin-identities)",
            )
        return await handler(request)

    # --- endpoints -------------------------------------------------------------------------------------

    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        # The protocol: 200 for true, a 4xx for false (Triton answers 400).
        return web.Response(status=200 if self.plane.ready() else 400)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "name": self.handler.name,
                "version": pipeline.__version__,
                "extensions": ["binary_tensor_data", *self.plane.extensions],
            }
        )

    async def model_metadata(self, request: web.Request) -> web.Response:
        name, version = _model_of(request)
        reply = await self.plane.model_metadata(name, version, _call_of(request))
        return web.json_response(metadata_json(reply))

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = _model_of(request)
        return web.Response(status=200 if await self.plane.model_ready(name, version) else 400)

    async def model_config(self, request: web.Request) -> web.Response:
        name, version = _model_of(request)
        config = await self.plane.model_config(name, version, _call_of(request))
        # Every field, as Triton writes it: a client reads `max_batch_size` of a model that does not batch (0).
        return web.json_response(message_json(config, every_field=True))

    async def statistics(self, request: web.Request) -> web.Response:
        name, version = _model_of(request)
        reply = await self.plane.statistics(name, version)
        return web.json_response(message_json(reply, every_message=True))

    async def repository_index(self, request: web.Request) -> web.Response:
        doc = await self._json_body(request)
        ready = json_field(doc, "ready", bool, "request", False)
        reply = await self.plane.repository_index(ready)
        return web.json_response([message_json(model) for model in reply.models])

    async def repository_load(self, request: web.Request) -> web.Response:
        doc = await self._json_body(request)
        await self.plane.repository_load(
            request.match_info["model"],
            json_field(doc, "parameters", dict, "request", {}),
            _repository_call(request),
        )
        return web.Response(status=200)

    async def repository_unload(self, request: web.Request) -> web.Response:
        doc = await self._json_body(request)
        await self.plane.repository_unload(
            request.match_info["model"],
            json_field(doc, "parameters", dict, "request", {}),
            _repository_call(request),
        )
        return web.Response(status=200)

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        encoding = check_encoding(request.headers.get("Content-Encoding", ""))
        return await self.codec.json_body(await request.read(), encoding, self.max_body_bytes)

    async def infer(self, request: web.Request) -> web.StreamResponse:
        name, version = _model_of(request)
        encoding = check_encoding(request.headers.get("Content-Encoding", ""))
        budget = self.handler.budget
        # A body whose length is told is refused by what it would cost before it is read, as a gRPC
        # `ModelInfer` is at the door (`pipeline.runtime.admission`).
        if request.content_length is not None and not budget.fits(cost_of(request.content_length)):
            raise budget.refusal(cost_of(request.content_length))
        # NOTE: the body is read whole before the codec takes a worker, so a client that sends slowly
        # holds none; the read is bounded by the application's client_max_size.
        body = await request.read()
        # The body's bytes count in the server's budget of bytes in flight from here, its request's (twice:
        # it is sent on) and response's as they are made; past it, refused before it is decoded.
        held = len(body)
        budget.admit(held)
        try:
            infer_req, form = await self.codec.infer_request(
                body, encoding, request.headers.get(HEADER_LENGTH), name, version, self.max_body_bytes
            )
            del body
            budget.charge(size := (REQUEST_COST - 1) * infer_req.ByteSize())
            held += size
            reply = await self.handler.infer(infer_req, _call_of(request))
            budget.charge(size := reply.ByteSize())
            held += size
            payload, header_length = await self.codec.infer_response(reply, form, self.max_json_output_bytes)
        finally:
            budget.release(held)
        response = web.Response(
            body=payload,
            content_type="application/json" if header_length is None else "application/octet-stream",
        )
        if header_length is not None:
            response.headers[HEADER_LENGTH] = str(header_length)
        response.enable_compression()  # only when Accept-Encoding asks for gzip or deflate
        return response

    async def _generate_request(self, request: web.Request) -> pb.ModelInferRequest:
        name, version = _model_of(request)
        meta = await self.plane.model_metadata(name, version, _call_of(request))
        inputs = {t.name: (t.datatype, list(t.shape)) for t in meta.inputs}
        encoding = check_encoding(request.headers.get("Content-Encoding", ""))
        body = decompressed(await request.read(), encoding, self.max_body_bytes)  # one small JSON object
        return generate_request(body, name, version, inputs, self.max_body_bytes)

    async def _responses(
        self, infer_req: pb.ModelInferRequest, call: RequestContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """The responses to a generate request: a decoupled model's, or a plain model's one."""
        if infer_req.model_name not in self.plane.decoupled:
            yield pb.ModelStreamInferResponse(infer_response=await self.handler.infer(infer_req, call))
            return
        replies: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue(maxsize=1)

        async def send(reply: pb.ModelStreamInferResponse) -> None:
            await replies.put(reply)

        async def run() -> None:
            try:
                await self.handler.stream(infer_req, call, send)
            finally:
                await replies.put(None)

        running = asyncio.create_task(run())
        try:
            while (reply := await replies.get()) is not None:
                yield reply
            await running
        finally:
            running.cancel()

    async def generate(self, request: web.Request) -> web.Response:
        """Triton's generate: one JSON object in, one out (a decoupled model must send one response)."""
        infer_req = await self._generate_request(request)
        found = [reply async for reply in self._responses(infer_req, _call_of(request))]
        for reply in found:
            if reply.error_message:
                raise _error_of(reply)
        if len(found) != 1:
            raise InvalidInput(
                f"model '{infer_req.model_name}' sent {len(found)} responses: ask generate_stream for them"
            )
        return web.json_response(generate_response(found[0].infer_response))

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """Triton's generate_stream: a Server-Sent Event per response, as the model makes them."""
        infer_req = await self._generate_request(request)
        events: web.StreamResponse | None = None
        async for reply in self._responses(infer_req, _call_of(request)):
            if events is None:
                if reply.error_message and is_final(reply):
                    raise _error_of(reply)  # refused before any response: a plain error answer
                events = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
                await events.prepare(request)
            doc = (
                {"error": reply.error_message}
                if reply.error_message
                else generate_response(reply.infer_response)
            )
            await events.write(b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n")
        if events is None:
            raise InvalidInput(f"model '{infer_req.model_name}' sent no response")
        await events.write_eof()
        return events


def _error_of(reply: pb.ModelStreamInferResponse) -> PipelineError:
    """The error a failed streamed response carries, with its status."""
    status = status_of(reply)
    code = next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
    return StageError(status.message or reply.error_message, code)


def _model_of(request: web.Request) -> tuple[str, str]:
    return request.match_info.get("model", ""), request.match_info.get("version", "")


def _call_of(request: web.Request) -> RequestContext:
    headers = request.headers
    return RequestContext(None, tuple((key, headers[key]) for key in _FORWARDED_HEADERS if key in headers))


def _repository_call(request: web.Request) -> RequestContext:
    """A repository change's call: the caller's credentials go on to the stages, which check them too."""
    call = _call_of(request)
    header = request.headers.get("Authorization")
    return call if header is None else RequestContext(None, (*call.metadata, ("authorization", header)))


# --- serving -------------------------------------------------------------------------------------------


class RestServer:
    """The HTTP site of a server, a door beside its gRPC server on the same event loop
    (`pipeline.runtime.lifecycle.Door`): where `--http-port` says, with the server's TLS settings."""

    def __init__(
        self,
        front_door: RestFrontDoor,
        settings: ProcessSettings,
        *,
        grace: float = 10.0,
        bound: Callable[[int], None] | None = None,
        reuse_port: bool = False,
    ) -> None:
        """`grace`: what in-flight requests get once it closes; `bound` is called with the port once it
        listens; `reuse_port` for router workers, which share the port (SO_REUSEPORT), as their gRPC servers
        do."""
        self.front_door = front_door
        self.http, self.host = settings.group(Http), settings.group(Listening).host
        self.ssl_context = server_ssl_context_of(settings.group(Security))
        self.grace = grace
        self.bound = bound
        self.reuse_port = reuse_port
        self._runner: web.AppRunner | None = None

    async def open(self, port: int) -> int:
        """Listen (not where `--http-port` is off), and write `--http-port-file`; returns the server's
        public port, `port`."""
        http, host, ssl_context = self.http, self.host, self.ssl_context
        if http.http_port is None:
            return port
        # Request bodies are decompressed by the codec, within the size limit and with the protocol's errors.
        runner = web.AppRunner(
            self.front_door.app(), access_log=None, shutdown_timeout=self.grace, auto_decompress=False
        )
        await runner.setup()
        site = web.TCPSite(
            runner, host, http.http_port, ssl_context=ssl_context, reuse_port=self.reuse_port or None
        )
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        bound_port = int(runner.addresses[0][1])
        write_port(http.http_port_file, bound_port)
        if self.bound is not None:
            self.bound(bound_port)
        log.info("HTTP/REST on %s://%s:%d/v2", "https" if ssl_context else "http", host, bound_port)
        return port

    async def close(self, grace: float) -> None:
        """Stop listening and let in-flight requests finish (within the grace period it was made with, on
        gRPC's clock), then the codec's workers."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        await self.front_door.codec.aclose()

"""TorchServe's Inference and Management APIs at the router's HTTP port, for the models of TorchServe archives
(`pipeline.runtime.torchserve_store`), answered as TorchServe 0.12 answers.

Inference: `POST /predictions/{model}[/{version}]` (any method, as TorchServe takes it) and `GET /ping`. The
request becomes TorchServe's parameters (the raw body as `body` with its content type; a multipart or
URL-encoded form's fields by name) and headers, packed into one BYTES element of the model's `TS_REQUEST`
input; it goes through the router's inference path (its batcher gathers `batch_size` requests, at most
`max_batch_delay` ms), and the handler's answer comes back in `TS_RESPONSE`: its body as the handler returned
it, its status, reason phrase and headers. Errors are TorchServe's JSON (`code`, `type`, `message`, indented
as its Gson writes them): 404 ModelNotFoundException, 404 ModelVersionNotFoundException, 503
InternalServerException "Prediction failed" for a handler that raised (the whole batch), ...

Management (TorchServe's port 8081; here the same port, behind the same credentials as the repository API:
register, scale and unregister need the admin scope): `POST /models?url=<archive of the model store>`
(`model_name`, `batch_size`, `max_batch_delay`, `initial_workers`, `response_timeout`), `GET /models`,
`GET /models/{model}[/{version}]`, `PUT /models/{model}[/{version}]?min_worker=&max_worker=`,
`DELETE /models/{model}[/{version}]`. Register writes the archive's folder into the model repository and
loads it on every replica of its stage (the repository API's fleet load), scale rewrites it with the new
instance count and reloads it, unregister unloads it and removes the folder. As in TorchServe 0.12, where
model control is off (`enable_model_api=false` there, model control mode `none` here) they answer 405.

A model whose handler runs as three stages (`pipeline run --split-handlers`) is served by the router as an
ensemble of its three methods' models: scale and unregister act on those three. Register makes one-stage
models only: the router's ensembles are read at start-up, so a split model, once unregistered, is not
registered again under its name.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
from aiohttp import BodyPartReader, web

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import PipelineError
from pipeline.runtime.data_plane import RequestContext
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.torchserve_store import (
    REQUEST_TENSOR,
    ArchiveModel,
    archive_model,
    archive_models,
    pack,
    read_model,
    refusal,
    remove_model,
    unpack,
    write_model,
)

log = logging.getLogger(__name__)

#: The routes that change what is served: they need the admin scope.
ADMIN_ROUTES = frozenset({"torchserve_register", "torchserve_scale", "torchserve_unregister"})
#: Paths anyone may call, as TorchServe's health check.
OPEN_PATHS = frozenset({"/ping"})
#: The answer of a management call where model control is off (TorchServe's `enable_model_api=false`).
_NOT_ALLOWED = (
    405,
    "MethodNotAllowedException",
    "Requested method is not allowed, please refer to API document.",
)
#: Gson, which writes TorchServe's JSON, escapes these characters.
_GSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "=": "\\u003d", "'": "\\u0027"}


def ts_json(doc: Any, status: int = 200) -> web.Response:
    """A JSON answer written as TorchServe writes its own (Gson, pretty-printed, then a newline)."""
    text = json.dumps(doc, indent=2)
    for char, escaped in _GSON_ESCAPES.items():
        text = text.replace(char, escaped)
    return web.Response(body=(text + "\n").encode(), status=status, content_type="application/json")


def ts_error(status: int, kind: str, message: str) -> web.Response:
    """TorchServe's error answer."""
    return ts_json({"code": status, "type": kind, "message": message}, status)


class TorchServeApi:
    """The routes over a server's `InferenceHandler` and its plane, for the archive models of `repository`;
    `store`: the model store that `POST /models` registers archives from (None: registering is refused)."""

    def __init__(self, handler: InferenceHandler, repository: Path | None, store: Path | None) -> None:
        self.handler = handler
        self.plane = handler.plane
        self.repository = repository
        self.store = store
        #: Archive models by name, as last read from the repository.
        self._models: dict[str, ArchiveModel] = {}

    def routes(self) -> list[web.RouteDef]:
        predictions = [
            web.route("*", "/predictions/{model}", self.predictions),
            web.route("*", "/predictions/{model}/{version}", self.predictions),
        ]
        management = []
        for path in ("/models/{model}", "/models/{model}/{version}"):
            management += [
                web.get(path, self.describe),
                web.put(path, self.scale, name=f"torchserve_scale{path.count('/')}"),
                web.delete(path, self.unregister, name=f"torchserve_unregister{path.count('/')}"),
            ]
        return [
            web.get("/ping", self.ping),
            *predictions,
            web.get("/models", self.list_models),
            web.post("/models", self.register, name="torchserve_register"),
            *management,
        ]

    @staticmethod
    def is_admin_route(name: str | None) -> bool:
        return name is not None and name.rstrip("0123456789") in ADMIN_ROUTES

    # --- inference -----------------------------------------------------------------------------------------

    async def ping(self, request: web.Request) -> web.Response:
        if self.plane.ready():
            return ts_json({"status": "Healthy"})
        return ts_json({"status": "Unhealthy"}, 500)

    async def predictions(self, request: web.Request) -> web.Response:
        name, version = request.match_info["model"], request.match_info.get("version")
        model = self._model(name)
        if model is None:
            return ts_error(404, "ModelNotFoundException", f"Model not found: {name}")
        if version is not None and version != model.version:
            return _version_not_found(name, version)
        blob = await _request_blob(request)
        infer_req = pb.ModelInferRequest(model_name=name)
        infer_req.inputs.add(name=REQUEST_TENSOR, datatype="BYTES", shape=[1, 1])
        infer_req.raw_input_contents.append(len(blob).to_bytes(4, "little") + blob)
        try:
            reply = await self.handler.infer(infer_req, RequestContext(None, ()))
        except PipelineError as err:
            if err.code == grpc.StatusCode.NOT_FOUND:
                self._models.pop(name, None)
                return ts_error(404, "ModelNotFoundException", f"Model not found: {name}")
            return ts_error(503, "ServiceUnavailableException", err.message)
        meta, parts = unpack(reply.raw_output_contents[0][4:])
        if "error" in meta:
            status = 507 if meta["status"] == 413 else int(meta["status"])
            return ts_error(status, "InternalServerException", str(meta["error"]))
        response = web.Response(body=parts[0], status=int(meta["status"]), reason=meta.get("phrase") or "")
        for key, value in meta["headers"].items():
            response.headers[key] = value
        if not any(key.lower() == "content-type" for key in meta["headers"]):
            # TorchServe writes no content type where the handler sets none.
            response.headers.popall("Content-Type", None)
        return response

    # --- management ----------------------------------------------------------------------------------------

    async def list_models(self, request: web.Request) -> web.Response:
        models = self._all_models()
        return ts_json({"models": [{"modelName": m.name, "modelUrl": m.url} for m in models]})

    async def describe(self, request: web.Request) -> web.Response:
        name, version = request.match_info["model"], request.match_info.get("version")
        model = self._model(name, fresh=True)
        if model is None:
            return ts_error(404, "ModelNotFoundException", f"Model not found: {name}")
        if version not in (None, "all", model.version):
            return _version_not_found(name, version or "")
        ready = await self.plane.model_ready(name, "")
        return ts_json([_description(model, ready)])

    async def register(self, request: web.Request) -> web.Response:
        query = request.query
        url = query.get("url")
        if not url:
            return ts_error(400, "BadRequestException", "Parameter url is required.")
        if self.store is None or self.repository is None:
            return ts_error(
                400, "BadRequestException", "this server has no model store (start it with --model-store DIR)"
            )
        try:
            settings = _register_settings(query)
        except ValueError as exc:
            return ts_error(400, "BadRequestException", str(exc))
        try:
            model = archive_model(self.store, url, query.get("model_name") or None, **settings)
        except PipelineError:
            return ts_error(404, "ModelNotFoundException", f"Model not found at: {url}")
        if (reason := refusal(model, install_dependencies=False)) is not None:
            # The router installs no requirements.txt: archives with one load at start-up only.
            return ts_error(400, "BadRequestException", reason)
        if self._model(model.name, fresh=True) is not None:
            return ts_error(
                409,
                "ConflictStatusException",
                f"Model version {model.version} is already registered for model {model.name}",
            )
        if await self._served_as_ensemble(model.name):
            return ts_error(
                409,
                "ConflictStatusException",
                f"Model {model.name} ran as three stages (--split-handlers) since start-up: register the "
                "archive under another model_name, or restart to serve it again",
            )
        write_model(self.repository, model)
        if model.min_workers > 0:
            try:
                await self.plane.repository_load(model.name, {}, _call_of(request))
            except PipelineError as err:
                remove_model(self.repository, model.name)
                return _management_error(err)
        self._models[model.name] = model
        return ts_json(
            {
                "status": f'Model "{model.name}" Version: {model.version} registered with '
                f"{model.min_workers} initial workers"
            }
        )

    async def scale(self, request: web.Request) -> web.Response:
        name, version = request.match_info["model"], request.match_info.get("version")
        model = self._model(name, fresh=True)
        if model is None or self.repository is None:
            return ts_error(404, "ModelNotFoundException", f"Model not found: {name}")
        if version is not None and version != model.version:
            return _version_not_found(name, version)
        try:
            minimum = _count(request.query, "min_worker", model.min_workers)
            maximum = max(minimum, _count(request.query, "max_worker", max(minimum, model.max_workers)))
        except ValueError as exc:
            return ts_error(400, "BadRequestException", str(exc))
        scaled = model.scaled(minimum, maximum)
        write_model(self.repository, scaled)
        try:
            for served in _served_models(scaled):
                if minimum > 0:
                    await self.plane.repository_load(served, {}, _call_of(request))
                else:
                    await self.plane.repository_unload(served, {}, _call_of(request))
        except PipelineError as err:
            write_model(self.repository, model)
            return _management_error(err)
        self._models[name] = scaled
        if request.query.get("synchronous", "false").lower() == "true":
            return ts_json({"status": f"Workers scaled to {minimum} for model: {name}"})
        return ts_json({"status": "Processing worker updates..."}, 202)

    async def unregister(self, request: web.Request) -> web.Response:
        name, version = request.match_info["model"], request.match_info.get("version")
        model = self._model(name, fresh=True)
        if model is None or self.repository is None:
            return ts_error(404, "ModelNotFoundException", f"Model not found: {name}")
        if version is not None and version != model.version:
            return _version_not_found(name, version)
        for served in _served_models(model):
            try:
                await self.plane.repository_unload(served, {}, _call_of(request))
            except PipelineError as err:
                if err.code != grpc.StatusCode.NOT_FOUND:  # registered with no worker: nothing is loaded
                    return _management_error(err)
        remove_model(self.repository, name)
        self._models.pop(name, None)
        return ts_json({"status": f'Model "{name}" unregistered'})

    # --- the archive models ---------------------------------------------------------------------------------

    def _model(self, name: str, *, fresh: bool = False) -> ArchiveModel | None:
        """The archive model `name`, from what was last read unless `fresh` (another router worker may have
        registered or unregistered it)."""
        if not fresh and name in self._models:
            return self._models[name]
        model = read_model(self.repository, name) if self.repository is not None else None
        if model is None:
            self._models.pop(name, None)
        else:
            self._models[name] = model
        return model

    async def _served_as_ensemble(self, name: str) -> bool:
        """Whether the router serves `name` as an ensemble (a split handler's, read at start-up)."""
        try:
            config = await self.plane.model_config(name, "", RequestContext(None, ()))
        except PipelineError:
            return False
        return config.platform == "ensemble"

    def _all_models(self) -> list[ArchiveModel]:
        return list(archive_models(self.repository)) if self.repository is not None else []


def _served_models(model: ArchiveModel) -> list[str]:
    """The stage models that serve an archive's model: its own, or its split handler's three."""
    return model.part_names() or [model.name]


def _version_not_found(name: str, version: str) -> web.Response:
    return ts_error(
        404, "ModelVersionNotFoundException", f"Model version: {version} does not exist for model: {name}"
    )


def _management_error(err: PipelineError) -> web.Response:
    if err.code == grpc.StatusCode.FAILED_PRECONDITION:
        return ts_error(*_NOT_ALLOWED)
    if err.code == grpc.StatusCode.PERMISSION_DENIED:
        return ts_error(403, "InvalidKeyException", err.message)
    return ts_error(500, "InternalServerException", err.message)


def _count(query: Mapping[str, str], key: str, default: int) -> int:
    text = query.get(key)
    if text is None:
        return default
    if not text.isdigit():
        raise ValueError(f"Parameter {key} must be a number of workers, got '{text[:40]}'")
    return int(text)


def _register_settings(query: Mapping[str, str]) -> dict[str, int]:
    """`POST /models`' settings of the model, TorchServe's defaults where the query leaves them out."""
    workers = _count(query, "initial_workers", 1)
    return {
        "batch_size": max(1, _count(query, "batch_size", 1)),
        "max_batch_delay_ms": _count(query, "max_batch_delay", 100),
        "min_workers": workers,
        "max_workers": workers,
        "response_timeout_s": _count(query, "response_timeout", 120),
    }


def _description(model: ArchiveModel, ready: bool) -> dict[str, Any]:
    """`GET /models/{model}`'s description, in TorchServe's fields."""
    workers = [
        {"id": str(9000 + i), "status": "READY" if ready else "UNLOADING", "gpu": False, "gpuUsage": "N/A"}
        for i in range(model.min_workers if ready else 0)
    ]
    return {
        "modelName": model.name,
        "modelVersion": model.version,
        "modelUrl": model.url,
        "runtime": model.runtime,
        "minWorkers": model.min_workers,
        "maxWorkers": model.max_workers,
        "batchSize": model.batch_size,
        "maxBatchDelay": model.max_batch_delay_ms,
        "responseTimeout": model.response_timeout_s,
        "loadedAtStartup": False,
        "workers": workers,
    }


def _call_of(request: web.Request) -> RequestContext:
    """A management call: the caller's credentials go on to the stages, which check them too."""
    header = request.headers.get("Authorization")
    return RequestContext(None, () if header is None else (("authorization", header),))


async def _request_blob(request: web.Request) -> bytes:
    """The request as TorchServe's frontend hands it to a worker: its headers and its parameters."""
    headers: dict[str, str] = dict(request.headers)
    headers["url_path"] = ""
    headers["explain"] = "False"
    parameters: list[tuple[str, str]] = []
    values: list[bytes] = []
    content_type = request.headers.get("Content-Type")
    mime = request.content_type if content_type is not None else ""
    if mime == "multipart/form-data":
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue  # a nested multipart body is no form field
            data = await part.read(decode=False)
            # A field's value has no content type (TorchServe hands it over as bytes), a file's has its own.
            kind = (
                "" if part.filename is None else part.headers.get("Content-Type", "application/octet-stream")
            )
            parameters.append((part.name or "", kind))
            values.append(bytes(data))
    elif mime == "application/x-www-form-urlencoded":
        body = await request.read()
        for key, value in urllib.parse.parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True):
            parameters.append((key, ""))
            values.append(value.encode("utf-8"))
    else:
        parameters.append(("body", mime))
        values.append(await request.read())
    return pack({"headers": headers, "parameters": parameters}, values)

"""A TorchServe handler loaded from an unpacked archive and run on batches as TorchServe runs it.

Loading follows TorchServe's model loader: the manifest's `handler` is a file of the archive (`name.py`, or
`name.py:function`) imported with the archive's folder first on `sys.path` (so it imports its extra files by
name); a module-level function (`handle` by default) is the entry point, called once with no data to
initialize, else the module's one class is made and its `initialize(context)` called. TorchServe's built-in
handler names (`image_classifier`, ...) are refused, naming the handler: ship the handler file instead.

Each model has its own modules: those imported from its folder are taken out of `sys.modules` once it has
loaded (the handler keeps them), so that two archives that both ship a `handler.py` or a `model.py` do not
share one. A handler that imports files of its archive later, while it handles a request, is not supported.

A batch: each request's parameters become the `{name: value}` dict the handler gets (the raw body is
`body`; a form's fields by their names), decoded as TorchServe decodes them: JSON for `application/json`,
text for `text/*`, else the bytes (a `bytearray`). The handler's list answers request by request: bytes as
they are, a string in UTF-8, a tensor as `torch.save` writes it, anything else as JSON (indented by two
spaces); with the status, reason phrase and headers the handler set on the context. An exception fails the
whole batch, with TorchServe's status and message: 503 "Prediction failed"; a `PredictionException`'s own
code and message; 507 "Out of resources" for memory (or CUDA memory).
"""

from __future__ import annotations

import importlib
import io
import json
import logging
import sys
import threading
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.protocol.errors import RepositoryError
from pipeline.runtime.torchserve_store import pack, unpack
from pipeline.stage.torchserve import ts as ts_package
from pipeline.stage.torchserve.ts import context as ts_context
from pipeline.stage.torchserve.ts import metrics_store as ts_metrics
from pipeline.stage.torchserve.ts import torch_handler, utils
from pipeline.stage.torchserve.ts.torch_handler import base_handler
from pipeline.stage.torchserve.ts.utils import util

log = logging.getLogger(__name__)

#: The `ts` modules a handler may import, under TorchServe's names.
TS_MODULES: dict[str, types.ModuleType] = {
    "ts": ts_package,
    "ts.context": ts_context,
    "ts.torch_handler": torch_handler,
    "ts.torch_handler.base_handler": base_handler,
    "ts.utils": utils,
    "ts.utils.util": util,
}

#: Loads change `sys.path` and `sys.modules`: one at a time.
_IMPORTS = threading.Lock()

Entry = Callable[[Any, Any], Any]


def install_ts() -> None:
    """Make `import ts...` give this project's handler API in this process (see `pipeline.stage.torchserve.ts`)."""
    sys.modules.update(TS_MODULES)


class HandlerService:
    """One instance of an archive's handler (a TorchServe worker)."""

    def __init__(
        self, name: str, model_dir: Path, manifest: dict[str, Any], batch_size: int, gpu_id: int | None
    ) -> None:
        self.name = name
        self.context = ts_context.Context(
            name,
            str(model_dir),
            manifest,
            batch_size,
            gpu_id,
            ts_package.__version__,
            True,
            ts_metrics.MetricsStore(),
        )
        handler = str(manifest["model"].get("handler") or "")
        install_ts()
        with _IMPORTS:
            sys.path.insert(0, str(model_dir))
            before = set(sys.modules)
            try:
                self.entry_point, self.handler = _entry_point(handler, model_dir, self.context)
            finally:
                sys.path.remove(str(model_dir))
                _forget_modules(set(sys.modules) - before, model_dir)

    def predict(self, rows: Sequence[bytes]) -> list[bytes]:
        """A batch of packed requests (`pipeline.runtime.torchserve_store.pack`), answered request by request."""
        data, headers = requests_of(rows)
        context = self.begin(headers)
        try:
            answers = self.entry_point(data, context)
        except Exception as exc:
            return failed(len(rows), *self.failure(exc, "invoking the handler"))
        return self.answer(answers, len(rows))

    def begin(self, headers: Sequence[dict[str, Any]]) -> ts_context.Context:
        """The context of a batch of requests with these headers, given to the handler."""
        context = self.context
        context.request_ids = {i: str(i) for i in range(len(headers))}
        context.request_processor = [ts_context.RequestProcessor(header) for header in headers]
        context.metrics.request_ids = context.request_ids
        if self.handler is not None:
            self.handler.context = context  # as BaseHandler.handle sets it, for the methods run one by one
        return context

    def failure(self, exc: Exception, doing: str) -> tuple[int, str]:
        """TorchServe's status and message for a batch the handler failed (logged)."""
        if isinstance(exc, MemoryError):
            log.error("model '%s': out of memory", self.name, exc_info=True)
            return 507, "Out of resources"
        if isinstance(exc, util.PredictionException):
            log.error("model '%s': prediction error", self.name, exc_info=True)
            return exc.error_code, exc.message
        if "CUDA" in str(exc):
            log.error("model '%s': CUDA out of memory", self.name, exc_info=True)
            return 507, "Out of resources"
        log.warning("model '%s': %s failed", self.name, doing, exc_info=True)
        return 503, "Prediction failed"

    def answer(self, answers: Any, count: int) -> list[bytes]:
        """The handler's answers to a batch of `count` requests, each packed with the status and headers the
        handler set on the context; a failed batch where they are not a list of one answer per request."""
        if not isinstance(answers, list):
            log.warning(
                "model '%s': the handler returned a %s, not a list", self.name, type(answers).__name__
            )
            return failed(count, 503, "Invalid model predict output")
        if len(answers) != count:
            log.warning("model '%s': %d answers to a batch of %d requests", self.name, len(answers), count)
            return failed(count, 503, "number of batch response mismatched")
        try:
            bodies = [_body(answer) for answer in answers]
        except TypeError:
            log.warning("model '%s': an answer that cannot be written as JSON", self.name, exc_info=True)
            return failed(count, 503, "Unsupported model output data type.")
        context = self.context
        out = []
        for index, body in enumerate(bodies):
            status, phrase = context.get_response_status(index)
            headers = context.get_response_headers(index)
            out.append(pack({"status": status, "phrase": phrase, "headers": headers}, [body]))
        context.request_processor = None
        return out


def requests_of(rows: Sequence[bytes]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The packed requests of a batch as the handler gets them (`{name: value}` dicts), and their headers."""
    data: list[dict[str, Any]] = []
    all_headers = []
    for row in rows:
        meta, parts = unpack(row)
        headers: dict[str, Any] = {}
        model_in: dict[str, Any] = {}
        for (name, content_type), value in zip(meta["parameters"], parts, strict=True):
            model_in[name] = _decoded(value, content_type)
            headers[name] = {"content-type": content_type}
        headers.update(meta["headers"])
        data.append(model_in)
        all_headers.append(headers)
    return data, all_headers


def _entry_point(handler: str, model_dir: Path, context: Any) -> tuple[Entry, Any]:
    """The handler's entry point, initialized with `context` (TorchServe's model loader, in our words), and
    the handler object whose `handle` it is (None for a module-level function)."""
    module_part, _, function_name = handler.partition(":")
    module_name = module_part.removesuffix(".py").rsplit("/", 1)[-1]
    if not (model_dir / f"{module_name}.py").is_file() and not (model_dir / module_name).is_dir():
        raise RepositoryError(
            f"model '{context.model_name}': handler '{handler}' is not a file of the archive; TorchServe's "
            "built-in handlers are not provided here: package the handler's file with the archive "
            "(torch-model-archiver --handler your_handler.py)"
        )
    sys.modules.pop(module_name, None)  # another archive's module of the same name
    module = importlib.import_module(module_name)
    function_name = function_name or "handle"
    if hasattr(module, function_name):
        function: Entry = getattr(module, function_name)
        function(None, context)
        return function, None
    classes = util.list_classes_from_module(module)
    if len(classes) != 1:
        raise RepositoryError(
            f"model '{context.model_name}': handler '{handler}' defines {len(classes)} classes and no "
            f"function '{function_name}'; TorchServe expects one class or a function entry point"
        )
    service = classes[0]()
    if not hasattr(service, "handle"):
        raise RepositoryError(f"model '{context.model_name}': {classes[0].__name__} has no handle method")
    service.initialize(context)
    method: Entry = service.handle
    return method, service


def _forget_modules(names: set[str], model_dir: Path) -> None:
    """Take the modules imported from the archive's folder out of `sys.modules` (the handler keeps them)."""
    for name in names:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file is not None and Path(file).resolve().is_relative_to(model_dir.resolve()):
            del sys.modules[name]


def _decoded(value: bytes, content_type: str) -> Any:
    """A request parameter as TorchServe hands it to the handler."""
    if content_type == "application/json":
        try:
            return json.loads(value.decode("utf-8"))
        except ValueError:
            return bytearray(value)
    if content_type.startswith("text"):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return bytearray(value)
    return bytearray(value)


def _body(answer: Any) -> bytes:
    """One answer as TorchServe writes it; TypeError where it cannot be written as JSON."""
    if isinstance(answer, bytes | bytearray):
        return bytes(answer)
    if isinstance(answer, str):
        return answer.encode("utf-8")
    if isinstance(answer, torch.Tensor):
        buffer = io.BytesIO()
        torch.save(answer, buffer)
        return buffer.getvalue()
    return json.dumps(answer, indent=2).encode("utf-8")


def failed(count: int, status: int, message: str) -> list[bytes]:
    """Every request of a failed batch answered with the same error."""
    return [pack({"status": status, "error": message})] * count

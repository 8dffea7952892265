"""Models written for Triton's Python backend (`TritonPythonModel`), served unmodified by the python backend
(`pipeline.stage.python_backend`): their config, the `args` their `initialize` gets, and their instances.

As in Triton, `auto_complete_config(pb_utils.ModelConfig)`, when the class defines it, completes the config
before anything else reads it (`pipeline.stage.triton_model_config`). A decoupled model
(`model_transaction_policy { decoupled: true }`) answers through `request.get_response_sender()`: its
`execute` returns None, and its responses may go on from other threads until one carries the final flag.
`execute` may be a coroutine function (Triton's async execute); it then runs on the service's own event loop,
as Triton runs it on its stub's: the model's `async_exec` calls go out with no thread between it and the
service, and the other instances and models run while it awaits them (one that holds the loop long goes to its
thread: `pipeline.stage.pool.LONG_STEP_S`). A model whose code calls `InferenceRequest.exec` (which blocks until its answer)
or names `decoupled` (whose responses are read by blocking) cannot wait on that loop: its coroutine runs to
completion on the instance's thread instead, as a decoupled model's and a sequence model's do, in an event
loop of the instance's own that lasts as long as the instance. An error a response carries is answered with
the gRPC status of its `TritonError` code (INVALID_ARG: INVALID_ARGUMENT, UNSUPPORTED: UNIMPLEMENTED,
INTERNAL, the default: INTERNAL, ...) and its message; so is a `TritonModelException` that `execute` raises
(INTERNAL), while any other exception is an internal error whose details stay in the log. A CANCELLED answer
to a request whose deadline has passed is DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import Message

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import (
    DeadlineExceeded,
    InvalidInput,
    PipelineError,
    RepositoryError,
    StageError,
    Unavailable,
)
from pipeline.protocol.model_config import (
    set_tensor_specs,
    tensor_specs,
)
from pipeline.protocol.proto_json import message_json
from pipeline.runtime.repository import RepositoryEntry
from pipeline.stage import triton_python_backend_utils as pb_utils
from pipeline.stage.api import NO_DEADLINE, Deadline
from pipeline.stage.backend import PreparedVersion, ResponseSink
from pipeline.stage.model_file import SharedModule, cause, device_of, instance_placements, where
from pipeline.stage.sequence_rows import Row
from pipeline.stage.triton_model_config import COMPLETED_FIELDS

_ERROR = pb_utils.TritonError
#: The gRPC status of each `TritonError` code (INVALID_ARG and UNAVAILABLE have error classes of their own).
_STATUS = {
    _ERROR.UNKNOWN: grpc.StatusCode.UNKNOWN,
    _ERROR.INTERNAL: grpc.StatusCode.INTERNAL,
    _ERROR.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    _ERROR.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    _ERROR.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    _ERROR.CANCELLED: grpc.StatusCode.CANCELLED,
}


def prepare_triton(
    entry: RepositoryEntry, version: str, path: Path, cls: type, module: SharedModule, gpus: int | None = None
) -> PreparedVersion:
    """A version of a `TritonPythonModel`: its config, completed and checked, and one unloaded instance per
    placement (`instance_placements`; `gpus` visible), each told where it runs as Triton tells it:
    `model_instance_kind` "CPU" or "GPU" and `model_instance_device_id`."""
    if not callable(getattr(cls, "execute", None)):
        raise RepositoryError(f"{path}: TritonPythonModel has no execute(requests) method")
    config = mc.ModelConfig()
    config.CopyFrom(entry.config)
    config.backend = "python"
    config.platform = config.platform or "python"
    hook = getattr(cls, "auto_complete_config", None)
    if callable(hook):
        auto_complete(config, hook, path)
    if not (config.input and config.output):
        raise RepositoryError(
            f"{path}: a TritonPythonModel needs its input and output tensors declared, as Triton's Python "
            f"backend does: in a config.pbtxt beside its version folders ({entry.folder / 'config.pbtxt'}), "
            "or by its auto_complete_config"
        )
    placements = instance_placements(config, entry.source, gpus)
    inputs, outputs = tensor_specs(config, entry.source)
    set_tensor_specs(config, inputs, outputs)
    model_config = json.dumps(triton_json(config))
    # A decoupled model's requests and a sequence's batches run on the instance's thread, whatever execute is.
    on_loop = (
        inspect.iscoroutinefunction(getattr(cls, "execute", None))
        and not config.model_transaction_policy.decoupled
        and not config.HasField("sequence_batching")
        and not _may_block(cls, module.module)
    )
    instances = []
    for instance_name, kind, device_id in placements:
        args = {
            "model_config": model_config,
            "model_instance_kind": kind,
            "model_instance_name": instance_name,
            "model_instance_device_id": str(device_id),
            "model_repository": str(entry.folder),
            "model_version": version,
            "model_name": entry.name,
        }
        instances.append(
            TritonInstance(
                cls, args, [spec.name for spec in outputs], device_of(kind, device_id), path, module, on_loop
            )
        )
    return PreparedVersion(config, list(instances))


def auto_complete(config: mc.ModelConfig, hook: Callable[[Any], Any], path: Path) -> None:
    """Let the model's `auto_complete_config` complete `config` (in place): the fields it may set
    (`COMPLETED_FIELDS`) are taken back, the rest is left as the config says."""
    try:
        returned = hook(pb_utils.ModelConfig(triton_json(config)))
    except Exception as exc:
        raise RepositoryError(
            f"{path}: TritonPythonModel.auto_complete_config failed: {where(exc, path)}{cause(exc)}"
        ) from None
    if not isinstance(returned, pb_utils.ModelConfig):
        raise RepositoryError(
            f"{path}: TritonPythonModel.auto_complete_config returned {_describe(returned)} instead of the "
            "pb_utils.ModelConfig it was given"
        )
    completed = returned.as_dict()
    try:
        parsed = json_format.ParseDict(
            {key: completed[key] for key in COMPLETED_FIELDS if key in completed}, mc.ModelConfig()
        )
    except json_format.ParseError as exc:
        raise RepositoryError(
            f"{path}: auto_complete_config left a config Triton would not read: {exc}"
        ) from None
    config.max_batch_size = parsed.max_batch_size
    for field in ("input", "output"):
        del getattr(config, field)[:]
        getattr(config, field).extend(getattr(parsed, field))
    for field in ("dynamic_batching", "model_transaction_policy"):
        if field in completed:
            getattr(config, field).SetInParent()
            getattr(config, field).CopyFrom(getattr(parsed, field))


def triton_json(message: Message) -> dict[str, Any]:
    """A config as Triton's Python backend hands it to `initialize`: protobuf's JSON mapping in the proto's
    field names, every field present, and 64-bit integers as numbers (protobuf writes them as strings; Triton
    converts them back)."""
    return message_json(message, every_field=True)


class TritonInstance:
    """One instance of a `TritonPythonModel`: `initialize` at load, `execute` per batch, `finalize` at unload."""

    inline = False
    #: `execute` may poll `is_cancelled()` while its request is cancelled by the event loop.
    inline_when_brief = False

    def __init__(
        self,
        cls: type,
        args: dict[str, str],
        outputs: list[str],
        device: str,
        path: Path,
        module: SharedModule,
        on_loop: bool = False,
    ) -> None:
        self.device = device
        self.reason = f"Triton Python model (TritonPythonModel) from {path}"
        self._cls = cls
        self._args = args
        self._outputs = outputs
        self._path = path
        self._module = module
        self._model: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Whether `execute` is a coroutine function that runs on the service's event loop (`run_async`).
        self.on_loop = on_loop

    def load(self) -> None:
        self._module.acquire()
        try:
            model = self._cls()
            initialize = getattr(model, "initialize", None)
            if initialize is not None:
                initialize(dict(self._args))
        except Exception as exc:
            self._module.release()
            raise RepositoryError(
                f"{self._path}: TritonPythonModel.initialize failed: {where(exc, self._path)}{cause(exc)}"
            ) from exc
        self._model = model

    def _request(
        self,
        inputs: Mapping[str, np.ndarray],
        deadline: Deadline,
        cancelled: Callable[[], bool],
        sender: pb_utils.InferenceResponseSender | None = None,
    ) -> pb_utils.InferenceRequest:
        remaining = deadline.remaining()
        return pb_utils.InferenceRequest(
            model_name=self._args["model_name"],
            inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()],
            requested_output_names=self._outputs,
            timeout=0 if remaining is None else max(1, int(remaining * 1e6)),
            cancelled=cancelled,
            response_sender=sender,
        )

    def _execute(self, *requests: pb_utils.InferenceRequest) -> Any:
        try:
            returned = self._model.execute(list(requests))
            if inspect.iscoroutine(returned):
                # Triton's async execute: run on this instance's own event loop, on its thread, which lives
                # as long as the instance (as the loop of Triton's stub process does): a loop made per call
                # would cost about 100 µs of CPU each time.
                if self._loop is None:
                    self._loop = asyncio.new_event_loop()
                returned = self._loop.run_until_complete(returned)
        except pb_utils.TritonModelException as exc:
            raise StageError(str(exc), grpc.StatusCode.INTERNAL) from None
        return returned

    def run(
        self, inputs: Mapping[str, np.ndarray], deadline: Deadline = NO_DEADLINE
    ) -> dict[str, np.ndarray]:
        return self._answer(self._execute(self._request(inputs, deadline, deadline.expired)), deadline)

    async def run_async(
        self, inputs: Mapping[str, np.ndarray], deadline: Deadline = NO_DEADLINE
    ) -> dict[str, np.ndarray]:
        """`run` of an `on_loop` instance, on the service's event loop."""
        try:
            responses = await self._model.execute([self._request(inputs, deadline, deadline.expired)])
        except pb_utils.TritonModelException as exc:
            raise StageError(str(exc), grpc.StatusCode.INTERNAL) from None
        return self._answer(responses, deadline)

    def _answer(self, responses: Any, deadline: Deadline) -> dict[str, np.ndarray]:
        """The outputs of the one response `execute` returned for a batch."""
        if not isinstance(responses, list | tuple) or len(responses) != 1:
            raise PipelineError(
                f"{self._path}: TritonPythonModel.execute must return a list of one InferenceResponse per "
                f"request; for 1 request it returned {_describe(responses)}"
            )
        response = responses[0]
        if not isinstance(response, pb_utils.InferenceResponse):
            raise PipelineError(
                f"{self._path}: TritonPythonModel.execute returned {_describe(response)} instead of an "
                "InferenceResponse"
            )
        error = response.error()
        if error is not None:
            raise model_error(error, deadline)
        return self._outputs_of(response)

    def run_requests(
        self, rows: Sequence[Row], deadline: Deadline = NO_DEADLINE
    ) -> list[dict[str, np.ndarray] | PipelineError]:
        """A sequence batch (`pipeline.stage.sequence_batcher`) as Triton hands it to `execute`: one request
        per row, each with its sequence's correlation id and flags; each response answers its own row (an
        error response fails that row alone). Every tensor a response carries comes back, state outputs
        included."""
        remaining = deadline.remaining()
        requests = [
            pb_utils.InferenceRequest(
                model_name=self._args["model_name"],
                inputs=[pb_utils.Tensor(name, array) for name, array in row.inputs.items()],
                requested_output_names=self._outputs,
                correlation_id=row.correlation_id,
                flags=row.flags,
                timeout=0 if remaining is None else max(1, int(remaining * 1e6)),
                cancelled=deadline.expired,
            )
            for row in rows
        ]
        responses = self._execute(*requests)
        if not isinstance(responses, list | tuple) or len(responses) != len(requests):
            raise PipelineError(
                f"{self._path}: TritonPythonModel.execute must return a list of one InferenceResponse per "
                f"request; for {len(requests)} requests it returned {_describe(responses)}"
            )
        results: list[dict[str, np.ndarray] | PipelineError] = []
        for response in responses:
            if not isinstance(response, pb_utils.InferenceResponse):
                raise PipelineError(
                    f"{self._path}: TritonPythonModel.execute returned {_describe(response)} instead of an "
                    "InferenceResponse"
                )
            error = response.error()
            if error is not None:
                results.append(model_error(error, deadline))
                continue
            try:
                outputs = self._outputs_of(response)
            except PipelineError as exc:
                results.append(exc)
                continue
            outputs.update({t.name(): np.asarray(t.as_numpy()) for t in response.output_tensors()})
            results.append(outputs)
        return results

    def _outputs_of(self, response: pb_utils.InferenceResponse) -> dict[str, np.ndarray]:
        outputs = {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}
        missing = [name for name in self._outputs if name not in outputs]
        if missing:
            raise PipelineError(
                f"{self._path}: TritonPythonModel returned no output {', '.join(missing)} "
                f"(it returned: {', '.join(outputs) or 'none'})"
            )
        # In the order the model set them: a decoupled model's responses list them so, as Triton's do.
        declared = set(self._outputs)
        return {name: np.asarray(array) for name, array in outputs.items() if name in declared}

    def run_decoupled(self, inputs: Mapping[str, np.ndarray], deadline: Deadline, sink: ResponseSink) -> None:
        """A decoupled model's `execute`: it answers through the request's sender, on this thread or any
        other, and returns None; the responses may go on after it returned."""

        def deliver(response: pb_utils.InferenceResponse | None, final: bool) -> None:
            if response is None:
                sink.send(None, None, final)
                return
            error = response.error()
            if error is not None:
                sink.send(None, model_error(error, deadline), final)
                return
            try:
                outputs = self._outputs_of(response)
            except PipelineError as exc:
                sink.send(None, exc, final)
                return
            sink.send(outputs, None, final)

        sender = pb_utils.InferenceResponseSender(deliver, sink.cancelled)
        returned = self._execute(self._request(inputs, deadline, sink.cancelled, sender))
        if returned is not None and not (isinstance(returned, list | tuple) and not returned):
            raise PipelineError(
                f"{self._path}: TritonPythonModel.execute of a decoupled model must return None (its responses "
                f"go through the request's response sender); it returned {_describe(returned)}"
            )

    def unload(self) -> None:
        model, self._model = self._model, None
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()
        if model is None:
            return
        try:
            finalize = getattr(model, "finalize", None)
            if finalize is not None:
                finalize()
        finally:
            self._module.release()


def _may_block(cls: type, module: types.ModuleType) -> bool:
    """Whether the code of the model's module (its functions, and its classes' methods) calls `InferenceRequest.exec` or names
    `decoupled`: waits that block the thread they are made on, which the service's event loop must never do."""
    values = [*vars(module).values(), *vars(cls).values()]
    for value in list(values):
        if isinstance(value, type) and value.__module__ == module.__name__:
            values += vars(value).values()
    code = [getattr(getattr(value, "__func__", value), "__code__", None) for value in values]
    return any(
        "exec" in names or "decoupled" in names for each in code if each is not None for names in _names(each)
    )


def _names(code: types.CodeType) -> Iterator[set[str]]:
    """The names and string constants (keyword arguments among them) each function of `code` uses, nested
    functions too."""
    yield {*code.co_names, *(c for c in code.co_consts if isinstance(c, str))}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)
        elif isinstance(const, tuple):  # the keyword names of a call
            yield {c for c in const if isinstance(c, str)}


def model_error(error: pb_utils.TritonError, deadline: Deadline = NO_DEADLINE) -> PipelineError:
    """The error a `TritonError` of a response is answered with (see the module docstring)."""
    code, message = error.code(), error.message()
    if code == _ERROR.INVALID_ARG:
        return InvalidInput(message)
    if code == _ERROR.UNAVAILABLE:
        return Unavailable(message)  # the model cannot take it now: the router may try another replica
    if code == _ERROR.CANCELLED and deadline.expired():
        return DeadlineExceeded(message)
    return StageError(message, _STATUS.get(code, grpc.StatusCode.INTERNAL))


def _describe(value: object) -> str:
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__

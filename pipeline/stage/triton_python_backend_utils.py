"""Triton's `triton_python_backend_utils`, for `model.py` files written for its Python backend.

The python backend (`pipeline.stage.python_backend`) registers this module under the name
`triton_python_backend_utils` before it imports a `model.py`, so `import triton_python_backend_utils as
pb_utils` works unchanged. What is here behaves as Triton's documented API does:

- tensors, requests and responses: `Tensor` (with DLPack), `InferenceRequest` (`is_cancelled()` turns true
  once the call's deadline has passed or its client has gone), `InferenceResponse` (with `parameters`);
- decoupled models (`model_transaction_policy { decoupled: true }`): `request.get_response_sender()` gives an
  `InferenceResponseSender` whose `send(response, flags=...)` sends each response as it is made, from any
  thread and also after `execute` returned None, until one carries `TRITONSERVER_RESPONSE_COMPLETE_FINAL`;
  `sender.is_cancelled()` tells the model its client has gone;
- errors: `TritonError` with its codes (`TritonError.INVALID_ARG`, ...: each becomes the matching gRPC
  status), and `TritonModelException`;
- `Logger` (`log_info`, `log_warn`, `log_error`, `log_verbose`, `log(message, Logger.INFO)`), writing to the
  service's log under the logger `triton_python_backend_utils`;
- the config helpers: `get_input_config_by_name`, `get_output_config_by_name`,
  `using_decoupled_model_transaction_policy`, and `ModelConfig`, which `auto_complete_config` gets;
- custom metrics (`pipeline.stage.triton_metrics`): `MetricFamily(name, description, kind)` of kind
  `MetricFamily.COUNTER`, `GAUGE` or `HISTOGRAM`, its `Metric(labels={...}, buckets=[...])`, and their
  `increment`, `set`, `observe` and `value`, shown on `/metrics` as Triton shows them;
- the type helpers `triton_string_to_numpy`, `triton_to_numpy_type`, `numpy_to_triton_type`,
  `serialize_byte_tensor`, `deserialize_bytes_tensor`, and Triton's `TRITONSERVER_*` flag constants.

- calls from a model to other models (Business Logic Scripting): `InferenceRequest(model_name=...,
  inputs=..., requested_output_names=...).exec()` from `execute`, `await request.async_exec()` from an
  `async def execute`, `request.exec(decoupled=True)` / `request.async_exec(decoupled=True)` for a
  decoupled callee (an iterator of its responses, with `cancel()`); the callee's errors come back as
  `has_error()` responses.
  The calls go through the router (`pipeline.stage.bls` says what they carry and how they are bounded).

Refused with a message saying so: the model loading API (`load_model`, ...), which belongs to the service
that runs the model (`RepositoryModelLoad`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from enum import IntEnum
from typing import Any, ClassVar

import grpc
import numpy as np

from pipeline.stage import bls

# Parts of the module's API kept in modules of their own: its datatype helpers, its errors, its custom
# metrics, and the `ModelConfig` that `auto_complete_config` gets.
from pipeline.stage.triton_datatypes import TRITON_STRING_TO_NUMPY as TRITON_STRING_TO_NUMPY
from pipeline.stage.triton_datatypes import deserialize_bytes_tensor as deserialize_bytes_tensor
from pipeline.stage.triton_datatypes import numpy_to_triton_type as numpy_to_triton_type
from pipeline.stage.triton_datatypes import serialize_byte_tensor as serialize_byte_tensor
from pipeline.stage.triton_datatypes import triton_string_to_numpy as triton_string_to_numpy
from pipeline.stage.triton_datatypes import triton_to_numpy_type as triton_to_numpy_type
from pipeline.stage.triton_errors import TritonError as TritonError
from pipeline.stage.triton_errors import TritonModelException as TritonModelException
from pipeline.stage.triton_metrics import Metric as Metric
from pipeline.stage.triton_metrics import MetricFamily as MetricFamily
from pipeline.stage.triton_metrics import MetricKind as MetricKind
from pipeline.stage.triton_model_config import ModelConfig as ModelConfig

#: Sequence flags of a request (Triton's `TRITONSERVER_RequestFlag`).
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
#: The flag of a decoupled model's last response (Triton's `TRITONSERVER_ResponseCompleteFlag`).
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
#: Release flags a model may set on a request (`InferenceRequest.set_release_flags`).
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
#: Where a called model's outputs should be put (`PreferredMemory`); outputs here are always in host memory.
TRITONSERVER_MEMORY_GPU = 0
TRITONSERVER_MEMORY_CPU = 1

#: Where a model's `Logger` lines go.
_model_log = logging.getLogger("triton_python_backend_utils")


class Logger:
    """Triton's model logger: lines go to the service's log, under the logger `triton_python_backend_utils`,
    naming the model file's line that wrote them. Verbose lines are logged at DEBUG."""

    class LogLevel(IntEnum):
        """The levels `Logger.log` takes (also as `Logger.INFO`, ...)."""

        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    INFO: ClassVar[LogLevel] = LogLevel.INFO
    WARNING: ClassVar[LogLevel] = LogLevel.WARNING
    ERROR: ClassVar[LogLevel] = LogLevel.ERROR
    VERBOSE: ClassVar[LogLevel] = LogLevel.VERBOSE

    _LEVELS: ClassVar[dict[int, int]] = {
        LogLevel.INFO: logging.INFO,
        LogLevel.WARNING: logging.WARNING,
        LogLevel.ERROR: logging.ERROR,
        LogLevel.VERBOSE: logging.DEBUG,
    }

    @staticmethod
    def log(message: str, level: int = LogLevel.INFO) -> None:
        """Log `message` at `level` (INFO when none is given)."""
        Logger._write(Logger._LEVELS.get(int(level), logging.INFO), message)

    @staticmethod
    def log_info(message: str) -> None:
        """Log `message` at INFO."""
        Logger._write(logging.INFO, message)

    @staticmethod
    def log_warn(message: str) -> None:
        """Log `message` at WARNING."""
        Logger._write(logging.WARNING, message)

    @staticmethod
    def log_error(message: str) -> None:
        """Log `message` at ERROR."""
        Logger._write(logging.ERROR, message)

    @staticmethod
    def log_verbose(message: str) -> None:
        """Log `message` at DEBUG (Triton's verbose level)."""
        Logger._write(logging.DEBUG, message)

    @staticmethod
    def _write(level: int, message: str) -> None:
        # stacklevel 3: the record names the model's line, not this method's or its caller's here.
        _model_log.log(level, "%s", message, stacklevel=3)


class Tensor:
    """A named numpy array, as Triton's Python backend passes tensors."""

    def __init__(self, name: str, value: np.ndarray) -> None:
        if not isinstance(value, np.ndarray):
            raise TritonModelException(f"Tensor '{name}': expected a numpy array, got {type(value).__name__}")
        self._name = name
        self._value = value

    def name(self) -> str:
        """The tensor's name."""
        return self._name

    def as_numpy(self) -> np.ndarray:
        """The tensor's data."""
        return self._value

    def to_dlpack(self) -> Any:
        """The tensor as a DLPack capsule (e.g. for `torch.utils.dlpack.from_dlpack`): its memory, or a copy of
        a read-only array (inputs are read-only views of the request bytes, which DLPack cannot mark)."""
        value = self._value if self._value.flags.writeable else self._value.copy()
        return value.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A tensor from a DLPack object in host memory (a torch CPU tensor, or what `to_dlpack` gives)."""
        if not hasattr(capsule, "__dlpack__"):
            capsule = _Capsule(capsule)
        return Tensor(name, np.from_dlpack(capsule))

    def is_cpu(self) -> bool:
        """Always True: tensors reach a stage as numpy arrays in host memory."""
        return True

    def shape(self) -> list[int]:
        """The tensor's shape."""
        return list(self._value.shape)

    def triton_dtype(self) -> int:
        """The tensor's datatype as Triton's `TRITONSERVER_DataType` number (the config's `TYPE_*` value)."""
        return numpy_to_triton_type(self._value.dtype)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._value.shape)}, dtype={self._value.dtype})"


class _Capsule:
    """A bare DLPack capsule, wrapped in the protocol `numpy.from_dlpack` expects."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: tensors here live in host memory


class PreferredMemory:
    """Where a called model's outputs should be put (Triton's `preferred_memory` of a BLS request). Accepted;
    outputs reach a model in host memory here, as numpy arrays, whatever it asks."""

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class InferenceTrace:
    """A request's trace context (Triton's): pass `request.trace()` to the requests a model makes, so that
    their spans sit under its own (they do by default too)."""

    def __init__(self, context: Mapping[str, str] | None = None) -> None:
        self._context = dict(context or {})

    def get_context(self) -> str | None:
        """The W3C trace context (`traceparent`, `tracestate`) as JSON, or None for an untraced request."""
        return json.dumps(self._context) if self._context else None

    @property
    def headers(self) -> dict[str, str]:
        """The trace context as the headers a call carries."""
        return dict(self._context)


class InferenceRequest:
    """A request: as `execute` receives it (its input tensors and the outputs asked for), or made by a model
    to call another model (`exec`, `async_exec`)."""

    def __init__(
        self,
        model_name: str = "",
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        request_id: str = "",
        correlation_id: int | str = 0,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: PreferredMemory | None = None,
        trace: InferenceTrace | None = None,
        parameters: Mapping[str, Any] | str | None = None,
        cancelled: Callable[[], bool] | None = None,
        response_sender: InferenceResponseSender | None = None,
    ) -> None:
        """Triton's arguments; `cancelled` is what `is_cancelled` asks (the runtime passes the call's deadline
        check), `response_sender` what `get_response_sender` gives (the runtime passes one to a decoupled
        model)."""
        self._model_name = model_name
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout
        self._preferred_memory = preferred_memory
        self._trace = trace
        self._cancelled = cancelled
        self._sender = response_sender
        if parameters is None:
            self._parameters = "{}"
        elif isinstance(parameters, str):
            self._parameters = parameters
        else:
            self._parameters = json.dumps(dict(parameters))

    def inputs(self) -> list[Tensor]:
        """Every input tensor the request carries."""
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        """The outputs asked for."""
        return list(self._requested)

    def request_id(self) -> str:
        """The request's id ("" here: one request carries a whole batch)."""
        return self._request_id

    def correlation_id(self) -> int | str:
        """The sequence id (0: none)."""
        return self._correlation_id

    def flags(self) -> int:
        """Sequence flags (0: none)."""
        return self._flags

    def timeout(self) -> int:
        """The request's timeout in microseconds (0: none): the time its call had left when it started."""
        return self._timeout

    def parameters(self) -> str:
        """The request's parameters as a JSON object."""
        return self._parameters

    def model_name(self) -> str:
        """The model the request is for."""
        return self._model_name

    def is_cancelled(self) -> bool:
        """Whether the request's answer is no longer wanted: its deadline passed or its client went away. A
        model may check it between pieces of work and answer `TritonError.CANCELLED`."""
        return self._cancelled is not None and self._cancelled()

    def trace(self) -> InferenceTrace:
        """The request's trace context: given to the requests a model makes, their spans sit under it."""
        if self._trace is not None:
            return self._trace
        scope = bls.current()
        return InferenceTrace(scope.trace_headers() if scope is not None else None)

    def exec(self, decoupled: bool = False) -> InferenceResponse | ResponseIterator:
        """Call the model this request names and wait for its response (an error comes back as a response
        that `has_error()`); `decoupled=True` for a decoupled model: an iterator of its responses."""
        scope = bls.current()
        if scope is None:
            return self._outside(decoupled)
        if decoupled:
            return ResponseIterator(scope.stream(self._call()))
        return _response(scope.submit(self._call()).result())

    def async_exec(self, decoupled: bool = False) -> asyncio.Future[Any]:
        """`exec` without waiting, from an `async def execute`: the call is sent at once, and the future
        (await it, or gather several) gives its response, or for a decoupled model an iterator of them."""
        loop = asyncio.get_running_loop()
        scope = bls.current()
        if scope is None or decoupled:
            done = loop.create_future()
            done.set_result(self.exec(decoupled) if scope is not None else self._outside(decoupled))
            return done
        if loop is scope.loop:  # an async execute that runs on the service's loop
            sent: asyncio.Future[bls.Reply] = scope.submit_here(self._call())
        else:
            sent = asyncio.wrap_future(scope.submit(self._call(), awaited=True), loop=loop)
        return _responded(sent, loop)

    def _outside(self, decoupled: bool) -> InferenceResponse | ResponseIterator:
        response = InferenceResponse(
            error=TritonError(
                f"InferenceRequest.exec (a call to model '{self._model_name}'): a model calls other models from "
                "execute, only while the service runs a request (not from initialize, finalize, a thread of "
                "its own, or a decoupled model)",
                TritonError.UNSUPPORTED,
            )
        )
        return ResponseIterator(None, [response]) if decoupled else response

    def _call(self) -> bls.BlsRequest:
        parameters = json.loads(self._parameters) if self._parameters != "{}" else {}
        if self._correlation_id:
            # As Triton's clients send a sequence's requests (sequence batching is not supported here: the
            # callee refuses it where it is declared).
            parameters["sequence_id"] = self._correlation_id
            parameters["sequence_start"] = bool(self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
            parameters["sequence_end"] = bool(self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
        return bls.BlsRequest(
            model=self._model_name,
            version="" if self._model_version < 0 else str(self._model_version),
            inputs={tensor.name(): tensor.as_numpy() for tensor in self._inputs},
            outputs=tuple(self._requested),
            request_id=self._request_id,
            timeout_us=self._timeout,
            parameters=parameters,
            trace=None if self._trace is None else self._trace.headers,
        )

    def get_response_sender(self) -> InferenceResponseSender:
        """The sender of this request's responses: a decoupled model's only way to answer."""
        if self._sender is None:
            raise TritonModelException(
                f"InferenceRequest.get_response_sender: model '{self._model_name}' is not decoupled, so it "
                "answers by returning one InferenceResponse per request from execute; declare "
                "model_transaction_policy { decoupled: true } in its config.pbtxt to send responses instead"
            )
        return self._sender

    def set_release_flags(self, flags: int) -> None:
        """Accepts `TRITONSERVER_REQUEST_RELEASE_ALL`; rescheduling a request is not supported."""
        if flags & TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
            raise TritonModelException(
                "rescheduling a request (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE) is not supported"
            )


class InferenceResponseSender:
    """Sends a decoupled model's responses to one request, as Triton's sender does: any number of
    `send(response)`, then one with `flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL` (with a last response, or
    none), from any thread. A send waits while the client has not read the responses sent before it;
    responses sent after the client has gone are dropped (`is_cancelled` says so)."""

    def __init__(
        self, deliver: Callable[[InferenceResponse | None, bool], None], cancelled: Callable[[], bool]
    ) -> None:
        """`deliver(response, final)` hands a response (None: the final flag alone) to the runtime."""
        self._deliver = deliver
        self._cancelled = cancelled
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send `response` (None only with the final flag); the final flag closes the sender."""
        if self._closed:
            raise TritonModelException(
                "Unable to send response. Response sender has been closed (the final flag was sent)."
            )
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException(
                "InferenceResponseSender.send: a response is needed unless flags carry "
                "TRITONSERVER_RESPONSE_COMPLETE_FINAL"
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"InferenceResponseSender.send: expected an InferenceResponse, got {type(response).__name__}"
            )
        self._closed = final
        self._deliver(response, final)

    def is_cancelled(self) -> bool:
        """Whether the request's client has gone (or its deadline passed): its responses are not wanted."""
        return self._cancelled()

    @property
    def closed(self) -> bool:
        """Whether the final flag was sent."""
        return self._closed


class InferenceResponse:
    """What `execute` returns for each request: output tensors, or an error; and optional parameters."""

    def __init__(
        self,
        output_tensors: Sequence[Tensor] = (),
        error: TritonError | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors)
        self._error = error
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(dict(parameters or {}))

    def parameters(self) -> str:
        """The response's parameters as a JSON object."""
        return self._parameters

    def output_tensors(self) -> list[Tensor]:
        """The output tensors."""
        return list(self._outputs)

    def has_error(self) -> bool:
        """Whether the response carries an error."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The error, if any."""
        return self._error


class ResponseIterator:
    """The responses of a call to a decoupled model, as they come (the last may carry no tensors: the final
    flag alone); iterating waits for each. `cancel()` cancels the call."""

    def __init__(self, responses: bls.Responses | None, ready: Sequence[InferenceResponse] = ()) -> None:
        self._responses = responses
        self._ready = list(ready)

    def __iter__(self) -> Iterator[InferenceResponse]:
        return self

    def __next__(self) -> InferenceResponse:
        if self._ready:
            return self._ready.pop(0)
        reply = None if self._responses is None else self._responses.get()
        if reply is None:
            self._responses = None
            raise StopIteration
        return _response(reply)

    def cancel(self) -> None:
        """Cancel the call: the model stops sending (an error response CANCELLED may end the iteration)."""
        if self._responses is not None:
            self._responses.cancel()


#: The `TritonError` code of a called model's gRPC status (Triton answers a timed-out or refused request
#: UNAVAILABLE).
_TRITON_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: TritonError.INVALID_ARG,
    grpc.StatusCode.NOT_FOUND: TritonError.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE: TritonError.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: TritonError.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: TritonError.UNAVAILABLE,
    grpc.StatusCode.UNIMPLEMENTED: TritonError.UNSUPPORTED,
    grpc.StatusCode.ALREADY_EXISTS: TritonError.ALREADY_EXISTS,
    grpc.StatusCode.CANCELLED: TritonError.CANCELLED,
    grpc.StatusCode.UNKNOWN: TritonError.UNKNOWN,
}


def _response(reply: bls.Reply) -> InferenceResponse:
    """A called model's reply as the model sees it."""
    if reply.code is not None:
        code = _TRITON_CODES.get(reply.code, TritonError.INTERNAL)
        return InferenceResponse(error=TritonError(reply.message, code), parameters=reply.parameters)
    tensors = [Tensor(name, array) for name, array in reply.outputs.items()]
    return InferenceResponse(tensors, parameters=reply.parameters)


def _responded(sent: asyncio.Future[bls.Reply], loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
    """A future of the response to the call whose reply `sent` will hold; cancelling it cancels the call.
    Callbacks, not a task: a call's answer costs no coroutine step of its own."""
    answered: asyncio.Future[Any] = loop.create_future()

    def reply(sent: asyncio.Future[bls.Reply]) -> None:
        if answered.done():
            return
        if sent.cancelled():
            answered.cancel()
        elif (error := sent.exception()) is not None:
            answered.set_exception(error)
        else:
            try:
                answered.set_result(_response(sent.result()))
            except Exception as exc:  # answered, never left pending
                answered.set_exception(exc)

    def dropped(answered: asyncio.Future[Any]) -> None:
        if answered.cancelled():
            sent.cancel()

    sent.add_done_callback(reply)
    answered.add_done_callback(dropped)
    return answered


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    """The request's input tensor called `name`, or None when the request does not carry it."""
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    """The response's output tensor called `name`, or None."""
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The `input` entry of a model config (the dict of `json.loads(args["model_config"])`) called `name`."""
    return next((t for t in model_config.get("input", ()) if t.get("name") == name), None)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The `output` entry of a model config (the dict of `json.loads(args["model_config"])`) called `name`."""
    return next((t for t in model_config.get("output", ()) if t.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    """Whether a model config (the dict of `json.loads(args["model_config"])`) declares the model decoupled."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def is_model_ready(model_name: str, model_version: str = "", **_: Any) -> bool:
    """Refused: the model loading API (Triton's, for BLS models) is not supported."""
    raise TritonModelException(_LOADING_REFUSED.format(call="is_model_ready", model=model_name))


def load_model(model_name: str, config: str = "", files: Mapping[str, bytes] | None = None, **_: Any) -> None:
    """Refused, as `is_model_ready` is."""
    raise TritonModelException(_LOADING_REFUSED.format(call="load_model", model=model_name))


def unload_model(model_name: str, unload_dependents: bool = False, **_: Any) -> None:
    """Refused, as `is_model_ready` is."""
    raise TritonModelException(_LOADING_REFUSED.format(call="unload_model", model=model_name))


_LOADING_REFUSED = (
    "{call}('{model}'): the model loading API is not supported by this server: models are loaded by the "
    "service that runs them (RepositoryModelLoad there, with --model-control-mode explicit)"
)

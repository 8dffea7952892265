"""The common subset of Triton's `triton_python_backend_utils`, for `model.py` files written for its Python
backend.

The python backend (`pipeline.stage.python_backend`) registers this module under the name
`triton_python_backend_utils` before it imports a `model.py`, so `import triton_python_backend_utils as
pb_utils` works unchanged. What is here behaves as Triton's does: `Tensor` (with DLPack), `InferenceRequest`,
`InferenceResponse`, `TritonError`, `TritonModelException`, `get_input_tensor_by_name`,
`get_output_tensor_by_name`, `get_input_config_by_name`, `get_output_config_by_name` and
`triton_string_to_numpy`. Calls from a model into other models (BLS, `InferenceRequest(...).exec()`) are
refused: stages call no other models here; an ensemble chains them instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.protocol.datatypes import DATATYPES


class TritonModelException(Exception):
    """What Triton raises for a failed model call; a model may raise it too."""


class TritonError:
    """An error carried by an `InferenceResponse` (Triton's codes as class attributes)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = str(message)
        self._code = code

    def message(self) -> str:
        """The error's text."""
        return self._message

    def code(self) -> int:
        """One of the class's codes."""
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r})"


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


class InferenceRequest:
    """A request as `execute` receives it: its input tensors and the outputs asked for.

    Building one inside a model to call another model (BLS) is allowed, but `exec` and `async_exec` refuse.
    """

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
        parameters: Mapping[str, Any] | str | None = None,
        cancelled: Callable[[], bool] | None = None,
        **_: Any,
    ) -> None:
        """Triton's arguments; `cancelled` is what `is_cancelled` asks (the runtime passes the call's deadline
        check)."""
        self._model_name = model_name
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._flags = flags
        self._timeout = timeout
        self._cancelled = cancelled
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

    def exec(self, *_: Any, **__: Any) -> InferenceResponse:
        """Refused: calling other models from a model (BLS) is not supported; chain them in an ensemble."""
        raise TritonModelException(
            f"InferenceRequest.exec (a call to model '{self._model_name}' from inside a model, Triton's BLS) is "
            "not supported by this server: chain the models with an ensemble instead"
        )

    async def async_exec(self, *_: Any, **__: Any) -> InferenceResponse:
        """Refused, as `exec` is."""
        return self.exec()

    def get_response_sender(self) -> Any:
        """Refused: decoupled models (several responses per request) are not supported."""
        raise TritonModelException(
            "decoupled models (InferenceRequest.get_response_sender) are not supported by this server"
        )


class InferenceResponse:
    """What `execute` returns for each request: output tensors, or an error."""

    def __init__(self, output_tensors: Sequence[Tensor] = (), error: TritonError | None = None) -> None:
        self._outputs = list(output_tensors)
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        """The output tensors."""
        return list(self._outputs)

    def has_error(self) -> bool:
        """Whether the response carries an error."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The error, if any."""
        return self._error


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


def triton_string_to_numpy(triton_type: str) -> type:
    """The numpy type of a config datatype: "TYPE_FP32" → numpy.float32, "TYPE_STRING" → numpy.object_."""
    name = triton_type.removeprefix("TYPE_")
    datatype = "BYTES" if name == "STRING" else name
    if datatype not in DATATYPES:
        raise TritonModelException(f"unknown Triton datatype {triton_type!r}")
    return DATATYPES[datatype].type

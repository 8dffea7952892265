"""The errors of Triton's `triton_python_backend_utils`: `TritonModelException`, which its calls raise, and
`TritonError`, which a response carries (re-exported there; `pipeline.stage.triton_model` maps their codes to
gRPC statuses)."""

from __future__ import annotations


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
        return f"TritonError({self._message!r}, {self._code})"

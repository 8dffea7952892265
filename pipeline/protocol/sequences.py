"""The requests of a sequence (a stateful model's, Triton's `sequence_batching`): the request parameters that
say which sequence a request belongs to and where it stands in it, as the KServe v2 protocol and Triton's
clients write them (`sequence_id` a number or a string, `sequence_start`, `sequence_end`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import InvalidInput
from pipeline.protocol.parameters import TIMEOUT, int_parameter

#: The request parameters of a sequence's requests (the KServe v2 protocol's, as Triton's clients send them).
SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END = "sequence_id", "sequence_start", "sequence_end"
SEQUENCE_PARAMETERS = (SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END)
#: Triton's request flags, as `InferenceRequest.flags()` gives them to a Python model.
FLAG_START, FLAG_END = 1, 2


@dataclass(frozen=True)
class SequenceId:
    """A request's place in its sequence, from its parameters."""

    value: int | str
    start: bool
    end: bool
    #: The request's `timeout` (µs, 0: none): how long its sequence may wait for a sequence slot (Triton's
    #: sequence batcher answers a sequence that waits longer UNAVAILABLE).
    timeout_us: int = 0

    @property
    def flags(self) -> int:
        return (FLAG_START if self.start else 0) | (FLAG_END if self.end else 0)


def sequence_of(request: pb.ModelInferRequest) -> SequenceId | None:
    """The sequence a request belongs to (its `sequence_id`, `sequence_start` and `sequence_end` parameters);
    None where it names none (or 0, or ""). Raises `InvalidInput` for parameters of the wrong type."""
    parameters = request.parameters
    if SEQUENCE_ID not in parameters:
        return None
    param = parameters[SEQUENCE_ID]
    kind = param.WhichOneof("parameter_choice")
    value: int | str
    if kind == "string_param":
        value = param.string_param
    elif kind in ("int64_param", "uint64_param"):
        number: int = getattr(param, kind)
        value = number
        if number < 0:
            raise InvalidInput(f"parameter '{SEQUENCE_ID}' is {value}; a sequence id is an unsigned integer")
    else:
        raise InvalidInput(f"parameter '{SEQUENCE_ID}' must be an integer or a string, not a {kind}")
    flags = []
    for key in (SEQUENCE_START, SEQUENCE_END):
        if key not in parameters:
            flags.append(False)
            continue
        flag = parameters[key]
        if flag.WhichOneof("parameter_choice") != "bool_param":
            raise InvalidInput(f"parameter '{key}' must be a boolean")
        flags.append(flag.bool_param)
    if not value:
        return None
    timeout = int_parameter(parameters, TIMEOUT) or 0
    if timeout < 0:
        raise InvalidInput(f"parameter '{TIMEOUT}' is {timeout}; a timeout is a number of microseconds")
    return SequenceId(value, flags[0], flags[1], timeout)


def copy_sequence(source: pb.ModelInferRequest, target: pb.ModelInferRequest) -> None:
    """Give `target` the sequence parameters of `source` and, where it has them, its `timeout` (as Triton gives
    every step of an ensemble its request's correlation id, flags and timeout)."""
    if SEQUENCE_ID not in source.parameters:
        return
    for key in (*SEQUENCE_PARAMETERS, TIMEOUT):
        if key in source.parameters:
            target.parameters[key].CopyFrom(source.parameters[key])


def sequence_key(sequence: SequenceId) -> str:
    """A sequence's id as text that tells the number 7 from the string "7" (they are two sequences)."""
    kind = "s" if isinstance(sequence.value, str) else "n"
    return f"{kind}:{sequence.value}"


def set_sequence(request: pb.ModelInferRequest, sequence: SequenceId) -> None:
    """Write a sequence's parameters into a request, as Triton's clients do."""
    if isinstance(sequence.value, str):
        request.parameters[SEQUENCE_ID].string_param = sequence.value
    else:
        request.parameters[SEQUENCE_ID].int64_param = sequence.value
    request.parameters[SEQUENCE_START].bool_param = sequence.start
    request.parameters[SEQUENCE_END].bool_param = sequence.end
    if sequence.timeout_us:
        request.parameters[TIMEOUT].int64_param = sequence.timeout_us

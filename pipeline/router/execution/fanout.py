"""A fan-out step's tensors: split into elements along the first dimension, and gathered back in order.

Each element keeps a first dimension of 1, so that it is a request of one item at the step model's
batcher; the elements' outputs are concatenated back (their bytes, for every datatype: a BYTES tensor's
raw form is its elements one after another), so an element's outputs come back where its inputs were.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import grpc

from pipeline.protocol.codec import Tensor
from pipeline.protocol.datatypes import DATATYPES
from pipeline.protocol.errors import InvalidInput, StageError
from pipeline.protocol.types import TensorSpec


def split(tensor: Tensor, where: str) -> list[Tensor]:
    """`tensor`'s elements along its first dimension, each of shape `[1, ...]`."""
    if not tensor.shape:
        raise InvalidInput(
            f"{where}: for_each tensor '{tensor.name}' is a scalar; it needs a first dimension"
        )
    count, rest = tensor.shape[0], tensor.shape[1:]
    if tensor.datatype == "BYTES":
        array = tensor.to_array()
        return [Tensor.from_array(tensor.name, array[i : i + 1]) for i in range(count)]
    row = math.prod(rest) * DATATYPES[tensor.datatype].itemsize
    view = memoryview(tensor.raw)
    return [
        Tensor(tensor.name, tensor.datatype, (1, *rest), bytes(view[i * row : (i + 1) * row]))
        for i in range(count)
    ]


def gather(name: str, pieces: Sequence[Tensor], spec: TensorSpec | None, where: str) -> Tensor:
    """The elements' outputs `pieces`, in order, as one tensor `name`; no pieces (no elements): an empty
    tensor shaped as `spec` (the model's output, its first dimension the batch) says, its variable
    dimensions 0."""
    if not pieces:
        if spec is None:
            raise StageError(
                f"{where}: no element, and the model's output '{name}' is unknown", grpc.StatusCode.INTERNAL
            )
        return Tensor(name, spec.datatype, (0, *(max(d, 0) for d in spec.shape[1:])), b"")
    first = pieces[0]
    rest = first.shape[1:]
    for index, piece in enumerate(pieces):
        if piece.shape[1:] != rest or piece.datatype != first.datatype:
            raise StageError(
                f"{where}: element {index}'s output '{name}' is {piece.datatype} {list(piece.shape)}, element "
                f"0's {first.datatype} {list(first.shape)}: the elements' outputs are gathered along the first "
                "dimension, so the rest of their shapes must agree",
                grpc.StatusCode.INTERNAL,
            )
    count = sum(piece.shape[0] for piece in pieces)
    return Tensor(name, first.datatype, (count, *rest), b"".join(piece.raw for piece in pieces))

"""Merging requests' tensors into one batch for a stage call, and splitting its outputs back.

Fixed-shape tensors merge by concatenating their raw bytes and split by byte offsets: no element is
decoded. Only tensors a stage declares padded (`TensorSpec.pad_value`) are touched element-wise: requests
whose variable dimensions differ are padded to the batch's largest (BYTES with empty elements), and outputs whose variable dimensions
follow those inputs are cut back to each request's own extent.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.ensemble.plan import ModelSignature
from pipeline.protocol.call_chain import CallChain
from pipeline.protocol.codec import Tensor
from pipeline.protocol.datatypes import DATATYPES, array_to_raw


@dataclass(slots=True)
class StageCall:
    """One request's share of a stage call: its inputs by stage tensor name, and the outputs it wants."""

    inputs: dict[str, Tensor]
    outputs: tuple[str, ...]
    #: The model version asked for ("" for the default).
    version: str = ""
    #: When the request gives up (`time.monotonic()`), None for never: a batch's stage call gets the latest
    #: of its members' deadlines, so that no stage works on for a batch every member has given up on.
    deadline: float | None = None
    #: The chain of model calls the request belongs to, when a model made it (Triton's BLS): a batch's
    #: stage call carries its members' chains merged.
    chain: CallChain | None = None
    #: Dimension 0: how many items the request carries (read from its inputs).
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = next(iter(self.inputs.values())).shape[0]


class TensorBatching:
    """How to merge and split one stage model's tensors, from its signature."""

    def __init__(self, signature: ModelSignature) -> None:
        self.pad = {s.name: s.pad_value for s in signature.inputs if s.pad_value is not None}
        # For each padded output: dim -> the padded input whose extent at that dim it follows.
        self.follows: dict[str, dict[int, str]] = {}
        for out in signature.outputs:
            if out.pad_value is None:
                continue
            dims = {}
            for d in range(1, len(out.shape)):
                if out.shape[d] != -1:
                    continue
                source = next(
                    (
                        s.name
                        for s in signature.inputs
                        if s.name in self.pad and len(s.shape) > d and s.shape[d] == -1
                    ),
                    None,
                )
                if source is not None:
                    dims[d] = source
            self.follows[out.name] = dims

    def key(self, call: StageCall) -> Hashable:
        """Requests with equal keys can share a batch: same outputs, datatypes, and shapes (but padded dims)."""
        return (
            call.version,
            call.outputs,
            tuple(
                (name, t.datatype, len(t.shape) if name in self.pad else t.shape[1:])
                for name, t in sorted(call.inputs.items())
            ),
        )

    def merge(self, calls: Sequence[StageCall]) -> list[Tensor]:
        """The inputs of one stage call carrying every request, in order."""
        merged = []
        for name in calls[0].inputs:
            tensors = [call.inputs[name] for call in calls]
            total = sum(t.shape[0] for t in tensors)
            trailing = tensors[0].shape[1:]
            if all(t.shape[1:] == trailing for t in tensors):
                raw = tensors[0].raw if len(tensors) == 1 else b"".join(t.raw for t in tensors)
                merged.append(Tensor(name, tensors[0].datatype, (total, *trailing), raw))
                continue
            # Only padded inputs get here: the key keeps other shapes apart.
            datatype = tensors[0].datatype
            trailing = tuple(max(t.shape[d] for t in tensors) for d in range(1, len(trailing) + 1))
            # BYTES elements are padded with empty strings (a numeric pad value means nothing for them).
            fill = b"" if datatype == "BYTES" else self.pad[name]
            out = np.full((total, *trailing), fill, dtype=DATATYPES[datatype])
            row = 0
            for tensor in tensors:
                array = tensor.to_array()
                out[(slice(row, row + array.shape[0]), *(slice(0, n) for n in array.shape[1:]))] = array
                row += array.shape[0]
            merged.append(Tensor(name, datatype, out.shape, array_to_raw(out)))
        return merged

    def split(self, outputs: Mapping[str, Tensor], calls: Sequence[StageCall]) -> list[dict[str, Tensor]]:
        """Each request's share of the stage's outputs (only the outputs it asked for)."""
        shares: list[dict[str, Tensor]] = [{} for _ in calls]
        for name, tensor in outputs.items():
            total = sum(call.size for call in calls)
            if not tensor.shape or tensor.shape[0] != total:
                raise RuntimeError(
                    f"output '{name}' has shape {list(tensor.shape)}; the batch of {total} needs dimension 0 = {total}"
                )
            follows = self.follows.get(name)
            if tensor.datatype == "BYTES" or follows:
                pieces = self._split_array(tensor, calls, follows or {})
            else:
                pieces = self._split_raw(tensor, calls)
            for share, call, piece in zip(shares, calls, pieces, strict=True):
                if name in call.outputs:
                    share[name] = piece
        return shares

    @staticmethod
    def _split_raw(tensor: Tensor, calls: Sequence[StageCall]) -> list[Tensor]:
        row = math.prod(tensor.shape[1:]) * DATATYPES[tensor.datatype].itemsize
        view = memoryview(tensor.raw)
        pieces, offset = [], 0
        for call in calls:
            n = call.size
            raw = tensor.raw if len(calls) == 1 else bytes(view[offset * row : (offset + n) * row])
            pieces.append(Tensor(tensor.name, tensor.datatype, (n, *tensor.shape[1:]), raw))
            offset += n
        return pieces

    @staticmethod
    def _split_array(tensor: Tensor, calls: Sequence[StageCall], follows: Mapping[int, str]) -> list[Tensor]:
        array = tensor.to_array()
        pieces, offset = [], 0
        for call in calls:
            n = call.size
            index: list[slice] = [slice(offset, offset + n)]
            for d in range(1, array.ndim):
                source = follows.get(d)
                index.append(slice(0, call.inputs[source].shape[d]) if source in call.inputs else slice(None))
            piece = array[tuple(index)]
            pieces.append(Tensor(tensor.name, tensor.datatype, piece.shape, array_to_raw(piece)))
            offset += n
        return pieces

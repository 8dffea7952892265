"""Requests' tensors merged into one batch along dimension 0, and a batch's outputs split back: the one home
of that rule for the router's batcher (`pipeline.router.scheduling.merge`), the calls a model makes that go
as one request (`pipeline.stage.bls`) and the sequence batcher's rows (`pipeline.stage.sequence_batcher`).

Arrays (`merge_arrays`, `split_arrays`) are the rule; the wire form (`merge_tensors`, `split_tensors`)
follows it without decoding an element where it can: tensors whose trailing shapes agree merge by joining
their raw bytes, and fixed-size outputs split at byte offsets. Parts whose trailing shapes differ merge only
where the tensor has a pad value: padded to the largest extent of each dimension (BYTES with empty elements
whatever the value). A split output can be cut back to each part's own extent of the dimensions that follow
its inputs (`extents`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.protocol.codec import Tensor
from pipeline.protocol.datatypes import DATATYPES, array_to_raw

#: For each output to cut back, one {dimension: extent} per part: where the part's own extent of that
#: dimension ends (the batch is padded past it).
Extents = Mapping[str, Sequence[Mapping[int, int]]]


class BatchShapeError(ValueError):
    """An output of a batch that is not one row per item of the batch."""

    def __init__(self, name: str, shape: Sequence[int], total: int) -> None:
        super().__init__(
            f"output '{name}' has shape {list(shape)}; the batch of {total} needs dimension 0 = {total}"
        )
        self.name = name


def merge_arrays(
    parts: Sequence[Mapping[str, np.ndarray]], pad: Mapping[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """The inputs of one batch carrying every part's rows, in order (the names are the first part's)."""
    if len(parts) == 1:
        return dict(parts[0])
    pad = pad or {}
    return {name: _merge([np.asarray(part[name]) for part in parts], pad.get(name)) for name in parts[0]}


def _merge(arrays: Sequence[np.ndarray], fill: Any) -> np.ndarray:
    trailing = arrays[0].shape[1:]
    if fill is None or all(array.shape[1:] == trailing for array in arrays):
        return np.concatenate(arrays)
    dtype = arrays[0].dtype
    # BYTES elements are padded with empty strings (a numeric pad value means nothing for them).
    shape = (
        sum(array.shape[0] for array in arrays),
        *(max(array.shape[d] for array in arrays) for d in range(1, len(trailing) + 1)),
    )
    out = np.full(shape, b"" if dtype.kind == "O" else fill, dtype=dtype)
    row = 0
    for array in arrays:
        out[(slice(row, row + array.shape[0]), *(slice(0, n) for n in array.shape[1:]))] = array
        row += array.shape[0]
    return out


def split_arrays(
    outputs: Mapping[str, np.ndarray], sizes: Sequence[int], extents: Extents | None = None
) -> list[dict[str, np.ndarray]]:
    """Each part's rows of a batch's outputs (views, no copy), the part that carried `sizes[i]` items
    getting the next `sizes[i]` rows; `BatchShapeError` where an output is not one row per item."""
    total = sum(sizes)
    for name, array in outputs.items():
        if array.shape[:1] != (total,):
            raise BatchShapeError(name, array.shape, total)
    parts: list[dict[str, np.ndarray]] = [{} for _ in sizes]
    for name, array in outputs.items():
        cut = extents.get(name) if extents else None
        start = 0
        for i, size in enumerate(sizes):
            rows = slice(start, start + size)
            parts[i][name] = array[rows] if not cut else array[(rows, *_cut(array.ndim, cut[i]))]
            start += size
    return parts


def _cut(ndim: int, extent: Mapping[int, int]) -> tuple[slice, ...]:
    return tuple(slice(0, extent[d]) if d in extent else slice(None) for d in range(1, ndim))


def merge_tensors(
    parts: Sequence[Mapping[str, Tensor]], pad: Mapping[str, Any] | None = None
) -> list[Tensor]:
    """`merge_arrays` in the wire form: the inputs of one batch, named by the first part's keys."""
    merged = []
    for name in parts[0]:
        tensors = [part[name] for part in parts]
        first = tensors[0]
        trailing = first.shape[1:]
        if len(tensors) == 1:
            # NOTE: a part's tensor may carry another name than its key (the ensemble's): the key names it.
            merged.append(
                first if first.name == name else Tensor(name, first.datatype, first.shape, first.raw)
            )
        elif all(t.shape[1:] == trailing for t in tensors):
            total = sum(t.shape[0] for t in tensors)
            merged.append(Tensor(name, first.datatype, (total, *trailing), b"".join(t.raw for t in tensors)))
        else:
            fill = (pad or {}).get(name)
            out = _merge([t.to_array() for t in tensors], fill)
            merged.append(Tensor(name, first.datatype, out.shape, array_to_raw(out)))
    return merged


def split_tensors(
    outputs: Mapping[str, Tensor], sizes: Sequence[int], extents: Extents | None = None
) -> list[dict[str, Tensor]]:
    """`split_arrays` in the wire form: each part's rows of a batch's outputs."""
    total = sum(sizes)
    parts: list[dict[str, Tensor]] = [{} for _ in sizes]
    for name, tensor in outputs.items():
        if tensor.shape[:1] != (total,):
            raise BatchShapeError(name, tensor.shape, total)
        cut = extents.get(name) if extents else None
        if len(sizes) == 1 and not cut:
            parts[0][name] = tensor
        elif tensor.datatype == "BYTES" or cut:
            pieces = split_arrays({name: tensor.to_array()}, sizes, {name: cut} if cut else None)
            for part, piece in zip(parts, pieces, strict=True):
                array = piece[name]
                part[name] = Tensor(name, tensor.datatype, array.shape, array_to_raw(array))
        else:
            row = math.prod(tensor.shape[1:]) * DATATYPES[tensor.datatype].itemsize
            view = memoryview(tensor.raw)
            start = 0
            for part, size in zip(parts, sizes, strict=True):
                raw = bytes(view[start * row : (start + size) * row])
                part[name] = Tensor(name, tensor.datatype, (size, *tensor.shape[1:]), raw)
                start += size
    return parts

"""What `pipeline bench` sends: inputs synthesised from a model's metadata or read from files, built into one
request, and the payloads the load sends request by request."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.codec import Tensor
from pipeline.protocol.datatypes import DATATYPES
from pipeline.tools.bench.options import BenchError
from pipeline.tools.client import value_array


def _resolve_shape(
    tensor: pb.ModelMetadataResponse.TensorMetadata, batching: bool, batch: int, fixed: Sequence[int] | None
) -> tuple[int, ...]:
    dims = list(tensor.shape)
    rest = dims[1:] if batching else dims
    if fixed is not None:
        if len(fixed) != len(rest):
            raise BenchError(
                f"--shape {tensor.name}: the model's shape {dims} has {len(rest)} non-batch dims, "
                f"got {list(fixed)}"
            )
        rest = [want if d == -1 else d for d, want in zip(rest, fixed, strict=True)]
    if any(d < 0 for d in rest):
        raise BenchError(
            f"input {tensor.name} has variable dims ({dims}); fix them with --shape {tensor.name}=d1,d2,..."
        )
    return (batch, *rest) if batching else tuple(rest)


def _random_array(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = DATATYPES[datatype]
    if datatype == "BYTES":
        out = np.empty(shape, dtype=object)
        flat = out.reshape(-1)
        for i in range(flat.size):
            flat[i] = rng.bytes(16)
        return out
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(size=shape).astype(dtype)


def synthesize_inputs(
    metadata: pb.ModelMetadataResponse,
    *,
    batching: bool,
    batch: int = 1,
    shapes: Mapping[str, Sequence[int]] | None = None,
    files: Mapping[str, Path] | None = None,
    values: Mapping[str, str] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """One request's inputs, by name: from `files` or `values` (one value filling the shape) where given,
    else random data of the declared type.

    A `.npy` file is the whole tensor as sent. Any other file is one BYTES element, repeated over the shape.
    `batching` says whether dim 0 is the batch dimension (then it is `batch`); `shapes` fixes the other
    variable dims, as Triton's perf_analyzer's `--shape` does.
    """
    shapes, files, values = shapes or {}, files or {}, values or {}
    known = {t.name for t in metadata.inputs}
    for name in (*shapes, *files, *values):
        if name not in known:
            raise BenchError(f"model '{metadata.name}' has no input {name!r} (inputs: {', '.join(known)})")
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for tensor in metadata.inputs:
        path = files.get(tensor.name)
        if path is not None and path.suffix == ".npy":
            arrays[tensor.name] = _load_npy(path, tensor.datatype)
            continue
        shape = _resolve_shape(tensor, batching, batch, shapes.get(tensor.name))
        if tensor.name in values:
            try:
                arrays[tensor.name] = value_array(tensor.datatype, values[tensor.name], shape)
            except ValueError as err:
                raise BenchError(f"--value {tensor.name}: {err}") from None
        elif path is None:
            arrays[tensor.name] = _random_array(tensor.datatype, shape, rng)
        elif tensor.datatype != "BYTES":
            raise BenchError(f"--input-file {tensor.name}: a {tensor.datatype} input needs a .npy file")
        else:
            data = path.read_bytes()
            array = np.empty(shape, dtype=object)
            array.reshape(-1)[:] = [data] * array.size
            arrays[tensor.name] = array
    return arrays


def _load_npy(path: Path, datatype: str) -> np.ndarray:
    """A `.npy` file's tensor, read without pickle. BYTES come from an array of fixed-width byte strings
    (`np.array([b"...", ...])`, dtype `S`) or of text (dtype `U`, sent as UTF-8)."""
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise BenchError(
            f"--input-file {path}: {exc}; BYTES inputs must be saved as byte strings (dtype S) or text "
            "(dtype U), not as Python objects"
        ) from None
    if datatype != "BYTES":
        return array
    if array.dtype.kind not in ("S", "U"):
        raise BenchError(
            f"--input-file {path}: a BYTES input needs byte strings or text, got dtype {array.dtype}"
        )
    elements = [e.encode() if isinstance(e, str) else bytes(e) for e in array.reshape(-1).tolist()]
    objects = np.empty(array.shape, dtype=object)
    objects.reshape(-1)[:] = elements
    return objects


_STAMP = struct.Struct("<Q")


@dataclass
class Payloads:
    """What the load sends, request by request: `items` in turn; or, with `repeat_share`, the first item
    again for that share of the requests (drawn at random) and, for the others, the first item with a
    counter written into its last 8 bytes (the end of the last input's data), so that no two are alike.

    `salt` keeps the counters of several load processes apart.
    """

    items: Sequence[Any]
    repeat_share: float | None = None
    seed: int = 0
    salt: int = 0

    def __post_init__(self) -> None:
        self._sent = 0
        self._rng = np.random.default_rng(self.seed)

    def next(self) -> Any:
        """The next request's payload."""
        self._sent += 1
        if self.repeat_share is None:
            return self.items[(self._sent - 1) % len(self.items)]
        first = self.items[0]
        if self._rng.random() < self.repeat_share:
            return first
        stamp = _STAMP.pack((self.salt << 48) | self._sent)
        if isinstance(first, tuple):  # HTTP: (body, header length)
            return first[0][: -len(stamp)] + stamp, first[1]
        return first[: -len(stamp)] + stamp


def build_request(model: str, version: str, arrays: Mapping[str, np.ndarray]) -> pb.ModelInferRequest:
    """The request every call sends: all inputs as raw contents."""
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    for name, array in arrays.items():
        tensor = Tensor.from_array(name, array)
        request.inputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
        request.raw_input_contents.append(tensor.raw)
    return request

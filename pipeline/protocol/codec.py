"""Conversions between the protocol's messages and tensors: the only module that reads tensor fields.

The router moves tensors as raw bytes (`Tensor`) and never decodes elements; stage servers turn them into
numpy arrays. Requests may carry typed `contents` instead of raw bytes (grpcurl and other JSON clients do);
those are converted to raw bytes once, on arrival.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.datatypes import DATATYPES, array_from_raw, array_to_raw, datatype_of, element_count
from pipeline.protocol.errors import InvalidInput, ModelNotFound, echo, names_of
from pipeline.protocol.types import TensorSpec

_LENGTH = struct.Struct("<I")

#: The `InferTensorContents` field that carries each datatype (FP16 and BF16 travel only as raw bytes).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


@dataclass(slots=True)
class Tensor:
    """A tensor in its wire form: datatype, shape and the raw bytes of its elements."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes

    def to_array(self) -> np.ndarray:
        """The tensor as a numpy array (a read-only view of `raw` for fixed-size datatypes)."""
        return array_from_raw(self.datatype, self.shape, self.raw, self.name)

    @classmethod
    def from_array(cls, name: str, array: np.ndarray) -> Tensor:
        """The wire form of an array."""
        return cls(name, datatype_of(array), tuple(array.shape), array_to_raw(array))


def request_tensors(request: pb.ModelInferRequest) -> list[Tensor]:
    """The input tensors of a request, with typed contents converted to raw bytes."""
    raw_contents = request.raw_input_contents
    if raw_contents and len(raw_contents) != len(request.inputs):
        raise InvalidInput(
            f"request has {len(request.inputs)} inputs but {len(raw_contents)} raw_input_contents; "
            "send raw contents for every input or for none"
        )
    tensors = []
    seen: set[str] = set()
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in seen:
            raise InvalidInput(f"input '{echo(name)}' appears more than once in the request")
        seen.add(name)
        if tensor.datatype not in DATATYPES:
            raise InvalidInput(
                f"input '{echo(name)}': unknown datatype '{echo(tensor.datatype)}' "
                f"(expected one of {', '.join(DATATYPES)})"
            )
        shape = tuple(tensor.shape)
        if any(d < 0 for d in shape):
            raise InvalidInput(f"input '{echo(name)}': shape {list(shape)} has a negative dimension")
        if raw_contents and tensor.HasField("contents"):
            # Triton refuses it too: which of the two would be the input's data?
            raise InvalidInput(
                f"input '{echo(name)}': contents must not be given when the request uses raw_input_contents"
            )
        raw = raw_contents[i] if raw_contents else _raw_from_contents(name, tensor.datatype, shape, tensor)
        tensors.append(Tensor(name, tensor.datatype, shape, raw))
    return tensors


def _raw_from_contents(
    name: str,
    datatype: str,
    shape: tuple[int, ...],
    tensor: pb.ModelInferRequest.InferInputTensor | pb.ModelInferResponse.InferOutputTensor,
) -> bytes:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidInput(f"input '{name}': {datatype} data must be sent in raw_input_contents")
    values = getattr(tensor.contents, field)
    count = element_count(shape)
    if len(values) != count:
        raise InvalidInput(
            f"input '{name}': shape {list(shape)} needs {count} elements, "
            f"but contents.{field} has {len(values)}"
        )
    if datatype == "BYTES":
        return b"".join(_LENGTH.pack(len(v)) + v for v in values)
    dtype = DATATYPES[datatype]
    wide = np.asarray(values)
    if dtype.kind in "iu" and wide.size:
        info = np.iinfo(dtype)
        if wide.min() < info.min or wide.max() > info.max:
            raise InvalidInput(f"input '{name}': contents.{field} has values outside the range of {datatype}")
    return wide.astype(dtype).tobytes()


def bytes_element_count(raw: bytes, name: str) -> int:
    """Count the elements of a raw BYTES tensor, checking that the length prefixes fit the data."""
    view = memoryview(raw)
    offset = count = 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise InvalidInput(f"input '{name}': BYTES element {count} has a truncated length prefix")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4 + length
        if offset > len(view):
            raise InvalidInput(
                f"input '{name}': BYTES element {count} declares {length} bytes, more than remain"
            )
        count += 1
    return count


def check_tensor(tensor: Tensor, spec: TensorSpec, model: str) -> None:
    """Check a tensor's datatype, shape and byte count against what the model declares."""
    name = tensor.name
    if tensor.datatype != spec.datatype:
        raise InvalidInput(
            f"input '{name}' of model '{model}': expected datatype {spec.datatype}, got {tensor.datatype}"
        )
    if len(tensor.shape) != len(spec.shape) or any(
        want not in (-1, got) for want, got in zip(spec.shape, tensor.shape, strict=True)
    ):
        raise InvalidInput(
            f"input '{name}' of model '{model}': expected shape {list(spec.shape)}, got {list(tensor.shape)}"
        )
    count = element_count(tensor.shape)
    if spec.datatype == "BYTES":
        if count * 4 > len(tensor.raw):
            raise InvalidInput(
                f"input '{name}' of model '{model}': shape {list(tensor.shape)} needs {count} BYTES "
                f"elements (at least {count * 4} bytes), got {len(tensor.raw)} bytes"
            )
        found = bytes_element_count(tensor.raw, name)
        if found != count:
            raise InvalidInput(
                f"input '{name}' of model '{model}': shape {list(tensor.shape)} needs {count} BYTES "
                f"elements, the data holds {found}"
            )
        return
    expected = count * DATATYPES[spec.datatype].itemsize
    if len(tensor.raw) != expected:
        raise InvalidInput(
            f"input '{name}' of model '{model}': {spec.datatype} shape {list(tensor.shape)} needs "
            f"{expected} bytes, got {len(tensor.raw)}"
        )


def validate_inputs(
    model: str, tensors: Iterable[Tensor], specs: Sequence[TensorSpec], max_batch_size: int
) -> dict[str, Tensor]:
    """Check a request's inputs against a model's declared inputs; return them by name.

    For a batching model every input must have the same dimension 0, between 1 and `max_batch_size`.
    """
    by_spec = {spec.name: spec for spec in specs}
    found: dict[str, Tensor] = {}
    for tensor in tensors:
        spec = by_spec.get(tensor.name)
        if spec is None:
            raise InvalidInput(
                f"unexpected input '{echo(tensor.name)}' for model '{model}' (expected: {names_of(by_spec)})"
            )
        check_tensor(tensor, spec, model)
        found[tensor.name] = tensor
    missing = [name for name, spec in by_spec.items() if name not in found and not spec.optional]
    if missing:
        raise InvalidInput(f"model '{model}' expects input(s) {names_of(missing)}, not in the request")
    if max_batch_size > 0 and found:
        batches = {t.shape[0] for t in found.values()}
        if len(batches) > 1:
            raise InvalidInput(
                f"inputs of model '{model}' disagree on the batch size (dimension 0): "
                + ", ".join(f"'{t.name}' has {t.shape[0]}" for t in found.values())
            )
        batch = batches.pop()
        if not 1 <= batch <= max_batch_size:
            raise InvalidInput(
                f"model '{model}': batch size {batch} is outside 1..{max_batch_size} (max_batch_size)"
            )
    return found


def requested_outputs(request: pb.ModelInferRequest, specs: Sequence[TensorSpec], model: str) -> list[str]:
    """Names of the outputs the client asked for, in the order asked; all outputs when none are named."""
    names = [spec.name for spec in specs]
    if not request.outputs:
        return names
    asked: list[str] = []
    for out in request.outputs:
        if "classification" in out.parameters:
            raise InvalidInput(
                f"output '{echo(out.name)}': the classification extension is not supported here"
            )
        if out.name in asked:  # Triton refuses it too
            raise InvalidInput(f"output '{echo(out.name)}' appears more than once in the request")
        asked.append(out.name)
    unknown = [name for name in asked if name not in names]
    if unknown:
        raise InvalidInput(
            f"model '{model}' has no output(s) {names_of(unknown)} (outputs: {names_of(names)})"
        )
    return asked


def infer_response(
    model: str, version: str, request_id: str, tensors: Iterable[Tensor]
) -> pb.ModelInferResponse:
    """A response carrying every tensor as `raw_output_contents` (what Triton's clients decode)."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for tensor in tensors:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(tensor.raw)
    return response


def response_tensors(response: pb.ModelInferResponse) -> dict[str, Tensor]:
    """The output tensors of a response, raw or typed, by name."""
    raw_contents = response.raw_output_contents
    tensors = {}
    for i, out in enumerate(response.outputs):
        shape = tuple(out.shape)
        if i < len(raw_contents):
            raw = raw_contents[i]
        else:
            raw = _raw_from_contents(out.name, out.datatype, shape, out)
        tensors[out.name] = Tensor(out.name, out.datatype, shape, raw)
    return tensors


def select_version(model: str, versions: Sequence[str], asked: str) -> str:
    """The version a request names, or the default (newest) one when it names none."""
    if not asked:
        return versions[-1]
    if asked not in versions:
        raise ModelNotFound(
            f"model '{echo(model)}' has no version '{echo(asked)}' (versions: {', '.join(versions)})"
        )
    return asked


def metadata_response(
    name: str,
    versions: Sequence[str],
    platform: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
) -> pb.ModelMetadataResponse:
    """`ModelMetadata` for a model: shapes as clients send them, -1 for variable (and batch) dims."""
    return pb.ModelMetadataResponse(
        name=name,
        versions=list(versions),
        platform=platform,
        inputs=[_tensor_metadata(s) for s in inputs],
        outputs=[_tensor_metadata(s) for s in outputs],
    )


def _tensor_metadata(spec: TensorSpec) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(name=spec.name, datatype=spec.datatype, shape=spec.shape)


def specs_from_metadata(
    metadata: Sequence[pb.ModelMetadataResponse.TensorMetadata],
) -> tuple[TensorSpec, ...]:
    """TensorSpecs from the tensor metadata another server reports."""
    return tuple(TensorSpec(t.name, t.datatype, tuple(t.shape)) for t in metadata)

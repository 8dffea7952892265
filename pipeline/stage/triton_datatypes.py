"""The datatype helpers of Triton's `triton_python_backend_utils` (re-exported there): config datatype names
and `TRITONSERVER_DataType` numbers to numpy types and back, and the layout of a serialized BYTES tensor
(each element a 4-byte little-endian length and its bytes)."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.datatypes import DATATYPES, datatype_of
from pipeline.protocol.model_config import config_datatype, datatype_of_config
from pipeline.stage.triton_errors import TritonModelException

_LENGTH = struct.Struct("<I")


def triton_string_to_numpy(triton_type: str) -> type:
    """The numpy type of a config datatype: "TYPE_FP32" → numpy.float32, "TYPE_STRING" → numpy.object_."""
    name = triton_type.removeprefix("TYPE_")
    datatype = "BYTES" if name == "STRING" else name
    if datatype not in DATATYPES:
        raise TritonModelException(f"unknown Triton datatype {triton_type!r}")
    return DATATYPES[datatype].type


#: Every config datatype name and its numpy type, as Triton's module offers them.
TRITON_STRING_TO_NUMPY: dict[str, type] = {
    name: triton_string_to_numpy(name)
    for name in mc.DataType.keys()  # noqa: SIM118 - an enum wrapper, not a dict
    if name not in ("TYPE_INVALID", "TYPE_BF16")
}


def triton_to_numpy_type(data_type: int) -> type | None:
    """The numpy type of a `TRITONSERVER_DataType` number (the config's `TYPE_*` value); None if unknown."""
    try:
        return DATATYPES[datatype_of_config(data_type)].type
    except ValueError:
        return None


def numpy_to_triton_type(data_type: Any) -> int:
    """The `TRITONSERVER_DataType` number of a numpy type (strings and bytes: TYPE_STRING)."""
    try:
        return int(config_datatype(datatype_of(np.empty(0, dtype=data_type))))
    except TypeError:
        raise TritonModelException(f"numpy type {data_type} has no Triton datatype") from None


def serialize_byte_tensor(tensor: np.ndarray) -> bytes:
    """A BYTES tensor (object array of bytes or str) as Triton lays it out: each element, in row-major order,
    as a 4-byte little-endian length and its bytes (str elements as UTF-8)."""
    parts = []
    for element in np.asarray(tensor, dtype=object).reshape(-1):
        data = element if isinstance(element, bytes) else str(element).encode("utf-8")
        parts += [_LENGTH.pack(len(data)), data]
    return b"".join(parts)


def deserialize_bytes_tensor(encoded: bytes) -> np.ndarray:
    """The elements of a serialized BYTES tensor, as a flat object array of bytes."""
    view, offset, elements = memoryview(encoded), 0, []
    while offset < len(view):
        if offset + 4 > len(view):
            raise TritonModelException(
                f"serialized BYTES tensor: a length prefix is cut off at byte {offset}"
            )
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > len(view):
            raise TritonModelException(f"serialized BYTES tensor: an element of {length} bytes is cut off")
        elements.append(bytes(view[offset : offset + length]))
        offset += length
    result = np.empty(len(elements), dtype=object)
    result[:] = elements
    return result

"""The protocol's tensor datatypes and their numpy forms, and the raw byte encoding of each.

Fixed-size datatypes travel as little-endian row-major bytes; BYTES travel as a 4-byte little-endian length
followed by the element's bytes, element after element. FP16 and BF16 travel only as raw bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from pipeline.protocol.errors import InvalidInput

#: Every datatype of the protocol and the numpy dtype that holds it (little-endian).
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}

_BY_DTYPE: dict[np.dtype, str] = {dt.newbyteorder("="): name for name, dt in DATATYPES.items()}
_LENGTH = struct.Struct("<I")


def datatype_of(array: np.ndarray) -> str:
    """The protocol datatype of a numpy array (strings and bytes arrays are BYTES)."""
    dtype = array.dtype
    found = _BY_DTYPE.get(dtype)  # a dtype in this machine's byte order: most arrays
    if found is not None:
        return found
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return _BY_DTYPE[dtype.newbyteorder("=")]
    except KeyError:
        raise TypeError(f"numpy dtype {array.dtype} has no protocol datatype") from None


def element_count(shape: Sequence[int]) -> int:
    """Number of elements in a tensor of this shape."""
    return math.prod(shape)


def byte_size(datatype: str, shape: Sequence[int]) -> int:
    """Raw byte size of a fixed-size tensor (not defined for BYTES)."""
    return element_count(shape) * DATATYPES[datatype].itemsize


def encode_bytes(elements: np.ndarray) -> bytes:
    """Raw form of a BYTES tensor: each element as a 4-byte little-endian length and its bytes."""
    parts: list[bytes] = []
    for element in elements.reshape(-1):
        data = element.encode("utf-8") if isinstance(element, str) else bytes(element)
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_bytes(raw: bytes | memoryview, count: int, name: str = "tensor") -> np.ndarray:
    """Split the raw form of a BYTES tensor into `count` elements (a flat object array of bytes)."""
    view = memoryview(raw)
    out = np.empty(count, dtype=object)
    offset = 0
    for i in range(count):
        if offset + 4 > len(view):
            raise InvalidInput(
                f"input '{name}': BYTES element {i} has no complete 4-byte length prefix "
                f"(expected {count} elements, the data ends at byte {len(view)})"
            )
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > len(view):
            raise InvalidInput(
                f"input '{name}': BYTES element {i} declares {length} bytes but only "
                f"{len(view) - offset} remain"
            )
        out[i] = bytes(view[offset : offset + length])
        offset += length
    if offset != len(view):
        raise InvalidInput(
            f"input '{name}': {len(view) - offset} bytes left over after {count} BYTES elements"
        )
    return out


def array_from_raw(datatype: str, shape: Sequence[int], raw: bytes, name: str = "tensor") -> np.ndarray:
    """Decode a raw tensor, checking its byte count against the datatype and shape.

    Fixed-size tensors are a read-only view of `raw` (no copy).
    """
    dtype = _dtype(datatype, name)
    count = element_count(shape)
    if datatype == "BYTES":
        return decode_bytes(raw, count, name).reshape(shape)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidInput(
            f"input '{name}': {datatype} shape {list(shape)} needs {expected} bytes, got {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def array_to_raw(array: np.ndarray) -> bytes:
    """Raw form of an array, in the protocol's byte order."""
    if datatype_of(array) == "BYTES":
        return encode_bytes(array)
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def _dtype(datatype: str, name: str) -> np.dtype:
    try:
        return DATATYPES[datatype]
    except KeyError:
        raise InvalidInput(
            f"input '{name}': unknown datatype '{datatype}' (expected one of {', '.join(DATATYPES)})"
        ) from None

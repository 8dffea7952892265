"""Codec round trips for every datatype (hypothesis), and the errors of malformed tensors. No sockets."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.codec import (
    Tensor,
    check_tensor,
    infer_response,
    request_tensors,
    requested_outputs,
    response_tensors,
    validate_inputs,
)
from pipeline.protocol.datatypes import (
    DATATYPES,
    array_from_raw,
    array_to_raw,
    datatype_of,
    decode_bytes,
    encode_bytes,
)
from pipeline.protocol.errors import InvalidInput, names_of
from pipeline.protocol.types import TensorSpec

FIXED = [name for name in DATATYPES if name != "BYTES"]
shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5)


@st.composite
def arrays_of(draw, datatype: str):
    shape = draw(shapes)
    if datatype == "BYTES":
        items = draw(
            st.lists(st.binary(max_size=40), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))
        )
        array = np.empty(len(items), dtype=object)
        array[:] = items
        return array.reshape(shape)
    if datatype == "BF16":
        bits = draw(hnp.arrays(np.uint16, shape))
        return bits.view(ml_dtypes.bfloat16)
    return draw(hnp.arrays(DATATYPES[datatype], shape))


def same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype == object:
        return a.shape == b.shape and a.tolist() == b.tolist()
    # Compare bit patterns so NaNs and signed zeros count as equal only when identical.
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("datatype", list(DATATYPES))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_raw_round_trip(datatype, data):
    array = data.draw(arrays_of(datatype))
    assert datatype_of(array) == datatype
    raw = array_to_raw(array)
    assert same(array_from_raw(datatype, array.shape, raw), array)


@pytest.mark.parametrize("datatype", list(DATATYPES))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_request_and_response_round_trip(datatype, data):
    array = data.draw(arrays_of(datatype))
    tensor = Tensor.from_array("T", array)
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="T", datatype=tensor.datatype, shape=tensor.shape)
    request.raw_input_contents.append(tensor.raw)
    wire = pb.ModelInferRequest.FromString(request.SerializeToString())
    (decoded,) = request_tensors(wire)
    check_tensor(decoded, TensorSpec("T", datatype, tuple(-1 for _ in array.shape)), "m")
    assert same(decoded.to_array(), array)
    response = pb.ModelInferResponse.FromString(infer_response("m", "1", "id", [decoded]).SerializeToString())
    assert same(response_tensors(response)["T"].to_array(), array)


@settings(max_examples=50, deadline=None)
@given(items=st.lists(st.binary(max_size=300), max_size=30))
def test_bytes_length_prefix(items):
    array = np.empty(len(items), dtype=object)
    array[:] = items
    raw = encode_bytes(array)
    assert len(raw) == sum(4 + len(i) for i in items)
    offset = 0
    for item in items:  # each element: 4-byte little-endian length, then the bytes
        assert struct.unpack_from("<I", raw, offset)[0] == len(item)
        offset += 4 + len(item)
    assert decode_bytes(raw, len(items)).tolist() == items


def test_strings_encode_as_utf8():
    assert encode_bytes(np.array(["é"], dtype=object)) == b"\x02\x00\x00\x00\xc3\xa9"


@pytest.mark.parametrize(
    ("raw", "count", "words"),
    [
        (b"\x05\x00\x00\x00abc", 1, "declares 5 bytes"),
        (b"\x01\x00", 1, "no complete 4-byte length prefix"),
        (b"\x01\x00\x00\x00ab", 1, "left over"),
        (b"", 1, "element 0"),
    ],
)
def test_lying_bytes_are_refused(raw, count, words):
    with pytest.raises(InvalidInput, match=words):
        decode_bytes(raw, count, "IMAGE")


@pytest.mark.parametrize("datatype", FIXED)
def test_wrong_byte_count_names_the_input(datatype):
    size = DATATYPES[datatype].itemsize
    with pytest.raises(InvalidInput, match=rf"'X'.*needs {2 * size} bytes, got {2 * size + 1}"):
        array_from_raw(datatype, (2,), b"\x00" * (2 * size + 1), "X")


def test_typed_contents_match_raw():
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="A", datatype="UINT8", shape=[3]).contents.uint_contents.extend([1, 2, 255])
    request.inputs.add(name="B", datatype="BYTES", shape=[2]).contents.bytes_contents.extend([b"x", b""])
    request.inputs.add(name="C", datatype="BOOL", shape=[2]).contents.bool_contents.extend([True, False])
    a, b, c = request_tensors(request)
    assert a.to_array().tolist() == [1, 2, 255] and a.to_array().dtype == np.uint8
    assert b.to_array().tolist() == [b"x", b""]
    assert c.to_array().tolist() == [True, False]


@pytest.mark.parametrize(
    ("datatype", "field", "values", "words"),
    [
        ("UINT8", "uint_contents", [256], "outside the range"),
        ("INT8", "int_contents", [-129], "outside the range"),
        ("FP32", "fp32_contents", [1.0, 2.0], "needs 1 elements"),
        ("FP16", "fp32_contents", [1.0], "raw_input_contents"),
        ("BF16", "fp32_contents", [1.0], "raw_input_contents"),
    ],
)
def test_bad_typed_contents(datatype, field, values, words):
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="X", datatype=datatype, shape=[1])
    getattr(tensor.contents, field).extend(values)
    with pytest.raises(InvalidInput, match=words):
        request_tensors(request)


def test_request_shape_errors():
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="X", datatype="FP32", shape=[-1, 2])
    request.raw_input_contents.append(b"")
    with pytest.raises(InvalidInput, match="negative dimension"):
        request_tensors(request)
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="X", datatype="FP99", shape=[1])
    request.raw_input_contents.append(b"")
    with pytest.raises(InvalidInput, match="unknown datatype 'FP99'"):
        request_tensors(request)
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="X", datatype="FP32", shape=[1])
    request.inputs.add(name="X", datatype="FP32", shape=[1])
    request.raw_input_contents.extend([b"\x00" * 4] * 2)
    with pytest.raises(InvalidInput, match="more than once"):
        request_tensors(request)


def test_huge_bytes_shape_is_refused_without_walking():
    tensor = Tensor("IMAGE", "BYTES", (2**40, 1), b"\x00" * 8)
    with pytest.raises(InvalidInput, match="needs 1099511627776 BYTES elements"):
        check_tensor(tensor, TensorSpec("IMAGE", "BYTES", (-1, 1)), "digits")


def test_validate_inputs_batch_bounds():
    spec = (TensorSpec("X", "FP32", (-1, 1)),)
    with pytest.raises(InvalidInput, match=r"batch size 0 is outside 1\.\.4"):
        validate_inputs("m", [Tensor("X", "FP32", (0, 1), b"")], spec, 4)
    assert validate_inputs("m", [Tensor("X", "FP32", (4, 1), b"\x00" * 16)], spec, 4)["X"].shape == (4, 1)


def test_errors_list_the_first_few_names_and_how_many_more():
    """A model with thousands of inputs or outputs makes short messages that still say what was expected."""
    specs = [TensorSpec(f"IN_{i}", "FP32", (1,)) for i in range(5000)]
    x = Tensor.from_array("X", np.zeros(1, np.float32))
    with pytest.raises(InvalidInput) as info:
        validate_inputs("wide", [x], specs, 0)
    assert info.value.message == (
        "unexpected input 'X' for model 'wide' (expected: IN_0, IN_1, IN_2, IN_3, IN_4, IN_5, IN_6, IN_7 "
        "and 4,992 more)"
    )
    with pytest.raises(InvalidInput) as info:
        validate_inputs("wide", [], specs, 0)
    assert info.value.message.endswith("IN_6, IN_7 and 4,992 more, not in the request")
    request = pb.ModelInferRequest(outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="Y")])
    with pytest.raises(InvalidInput) as info:
        requested_outputs(request, specs, "wide")
    assert info.value.message == (
        "model 'wide' has no output(s) Y (outputs: IN_0, IN_1, IN_2, IN_3, IN_4, IN_5, IN_6, IN_7 and 4,992 more)"
    )
    assert names_of(["a", "b"]) == "a, b" and names_of([]) == "none"
    assert names_of(["x" * 1000]) == "x" * 200 + "... (1000 characters)"

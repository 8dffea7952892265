"""The REST codec's limits: JSON inputs counted and weighed before they are made, a JSON response weighed
before it is written, and the JSON part of a body sized from its header."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import InvalidInput
from pipeline.router.frontdoor.rest_codec import (
    BodyTooLarge,
    JsonTooLarge,
    OutputForm,
    check_json_size,
    infer_request,
    infer_response_body,
    json_part_size,
)


def _request(datatype: str, shape: list[int], data) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "X", "datatype": datatype, "shape": shape, "data": data}]}
    ).encode()


def test_json_data_whose_count_disagrees_with_its_shape_is_refused_before_it_is_made():
    for data in ([1, 2, 3], [[1, 2], [3, 4], [5, 6]], list(range(100))):
        with pytest.raises(InvalidInput, match=r"shape \[2, 2\] needs 4 elements, 'data' has \d+"):
            infer_request(_request("INT32", [2, 2], data), None, "m", "")


def test_json_inputs_are_weighed_against_the_limit_before_they_are_made():
    # 100,000 zeros: 200 KB of JSON, but 800 KB as INT64: more than a 512 KB request may carry.
    body = _request("INT64", [100_000], [0] * 100_000)
    assert len(body) < 512 * 1024
    with pytest.raises(BodyTooLarge, match=r"more than the \d+ bytes left of what a request may carry"):
        infer_request(body, None, "m", "", 512 * 1024)
    request, _ = infer_request(body, None, "m", "", 1024 * 1024)
    assert len(request.raw_input_contents[0]) == 800_000
    # A shape far beyond the limit is refused as it is read, whatever its data.
    with pytest.raises(BodyTooLarge):
        infer_request(_request("FP64", [2**40], [1.0]), None, "m", "", 1024 * 1024)


def _response(values: np.ndarray) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name="m", model_version="1")
    response.outputs.add(name="Y", datatype="FP32", shape=list(values.shape))
    response.raw_output_contents.append(values.astype(np.float32).tobytes())
    return response


def test_a_json_response_is_estimated_before_it_is_written_and_refused_past_the_limit():
    response = _response(np.full((1, 100_000), 0.1))
    as_json, as_binary = OutputForm(False, {}), OutputForm(True, {})
    body, header_length = infer_response_body(response, as_json)
    assert header_length is None and json.loads(body)["outputs"][0]["data"][:1] == [float(np.float32(0.1))]
    estimate = check_json_size(response, as_json, 0)
    data = len(json.dumps(json.loads(body)["outputs"][0]["data"], separators=(",", ":")))
    assert 0.9 * data < estimate < 1.1 * data
    assert check_json_size(response, as_binary, 1) == 0  # binary outputs weigh nothing
    with pytest.raises(
        JsonTooLarge, match=r"would be about .* --max-json-output-mb\): ask for the outputs as binary"
    ):
        infer_response_body(response, as_json, data // 2)
    body, header_length = infer_response_body(response, as_binary, data // 2)
    assert header_length is not None and len(body) - header_length == 400_000


def test_the_json_part_of_a_body_is_what_its_header_says():
    assert json_part_size(1000, None) == 1000
    assert json_part_size(1000, "120") == 120
    for wrong in ("1001", "+5", "1_0", "３０", "9" * 5000):
        assert json_part_size(1000, wrong) == 0
        with pytest.raises(InvalidInput, match="Inference-Header-Content-Length"):
            infer_request(b"{}" + b"\0" * 998, wrong, "m", "")

"""Where the protocol leaves the server a choice, the router chooses as Triton does (or stricter): typed
contents beside raw ones, the classification extension, outputs asked twice, versions that are not served,
the version that answered, client strings echoed in errors, and the HTTP side's framing."""

from __future__ import annotations

import gzip
import json

import aiohttp
import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.stages import Scale

ENSEMBLES = """
name: scaled
stages:
  a: {{address: "{a}", dynamic_batching: {{max_batch_size: 8}}}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: scale, stage: a, input_map: {{X: X}}, output_map: {{Y: Y}}}}
---
name: plainly
stages:
  b: {{address: "{b}"}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: plain, stage: b, input_map: {{X: X}}, output_map: {{Y: Y}}}}
"""

X = np.array([[1, 2, 3]], np.float32)

#: A model name far longer than any real one: 100 KB, more than gRPC's 16 KB of trailers would carry.
LONG_NAME = "m" * 100_000


class Served:
    def __init__(self, grpc_address: str, http: str) -> None:
        self.grpc, self.http = grpc_address, http

    def url(self, path: str) -> str:
        return f"http://{self.http}{path}"


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    async with serving_stages([Scale()]) as a, serving_stages([Scale("plain")]) as b:
        folder = tmp_path_factory.mktemp("strict")
        for i, text in enumerate(ENSEMBLES.split("---\n")):
            (folder / f"e{i}.yaml").write_text(text.format(a=a.address, b=b.address))
        async with serving_router(load_ensembles([folder])) as router:
            await wait_serving(router.address)
            assert router.http_address is not None
            yield Served(router.address, router.http_address)


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


# --- gRPC ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["scaled", "scale", "plain"])
async def test_typed_contents_beside_raw_contents_are_refused(served, model):
    request = request_for(model, X=X)
    request.inputs[0].contents.fp32_contents.extend([9, 9, 9])
    async with inference_stub(served.grpc) as stub:
        err = await rpc_error(stub.ModelInfer(request, timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "contents" in err.details() and "raw_input_contents" in err.details() and "'X'" in err.details()


@pytest.mark.parametrize("model", ["scaled", "scale", "plain"])
async def test_the_classification_extension_is_refused_over_grpc_as_over_http(served, model):
    request = request_for(model, X=X)
    request.outputs.add(name="Y").parameters["classification"].int64_param = 2
    async with inference_stub(served.grpc) as stub:
        err = await rpc_error(stub.ModelInfer(request, timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "classification" in err.details() and "'Y'" in err.details()


@pytest.mark.parametrize("model", ["scaled", "scale", "plain"])
async def test_an_output_asked_twice_is_refused(served, model):
    request = request_for(model, X=X)
    request.outputs.add(name="Y")
    request.outputs.add(name="Y")
    async with inference_stub(served.grpc) as stub:
        err = await rpc_error(stub.ModelInfer(request, timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "output 'Y'" in err.details() and "more than once" in err.details()


@pytest.mark.parametrize("model", ["scaled", "scale", "plain"])
async def test_statistics_of_a_version_not_served_are_not_found(served, model):
    async with inference_stub(served.grpc) as stub:
        for version in ("abc", "2"):
            err = await rpc_error(
                stub.ModelStatistics(pb.ModelStatisticsRequest(name=model, version=version))
            )
            assert err.code() == grpc.StatusCode.NOT_FOUND, err.details()
            assert f"version '{version}'" in err.details()
        for version in ("", "1"):
            reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model, version=version))
            assert [(s.name, s.version) for s in reply.model_stats] == [(model, "1")]


@pytest.mark.parametrize("model", ["scaled", "scale", "plain"])
async def test_a_response_names_the_version_that_answered(served, model):
    async with inference_stub(served.grpc) as stub:
        for asked in ("", "1"):
            request = request_for(model, X=X)
            request.model_version = asked
            response = await stub.ModelInfer(request, timeout=10)
            assert (response.model_name, response.model_version) == (model, "1")


async def test_a_long_client_string_is_cut_short_in_the_error_that_echoes_it(served):
    async with inference_stub(served.grpc) as stub:
        calls = [
            stub.ModelInfer(request_for(LONG_NAME, X=X), timeout=10),
            stub.ModelMetadata(pb.ModelMetadataRequest(name=LONG_NAME), timeout=10),
            stub.ModelConfig(pb.ModelConfigRequest(name=LONG_NAME), timeout=10),
            stub.ModelStatistics(pb.ModelStatisticsRequest(name=LONG_NAME), timeout=10),
            stub.ModelStatistics(pb.ModelStatisticsRequest(name="scaled", version=LONG_NAME), timeout=10),
            stub.ModelInfer(request_for("scaled", **{LONG_NAME: X}), timeout=10),
        ]
        for call in calls:
            err = await rpc_error(call)
            # NOT_FOUND or INVALID_ARGUMENT as for a short name, not RESOURCE_EXHAUSTED for the trailers.
            assert err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), err.code()
            assert "mmmm" in err.details() and len(err.details()) < 2000, len(err.details())
            assert "100000 characters" in err.details()


# --- HTTP ----------------------------------------------------------------------------------------------


def _body() -> bytes:
    return json.dumps(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    ).encode()


async def test_junk_after_a_gzip_body_is_refused(served, http):
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    url = served.url("/v2/models/scaled/infer")
    async with http.post(url, data=gzip.compress(_body()), headers=headers) as reply:
        assert reply.status == 200, await reply.text()
    for junk in (b"junk", gzip.compress(b"{}")):  # bytes that are not gzip, and a second member
        async with http.post(url, data=gzip.compress(_body()) + junk, headers=headers) as reply:
            assert reply.status == 400, await reply.text()
            assert "after the end of the gzip data" in (await reply.json())["error"]


@pytest.mark.parametrize("value", ["\uff13\uff10", "1_0", "+5", "-0", "0x10", "\u0663"])
async def test_the_header_length_takes_ascii_digits_only(served, http, value):
    body = _body()
    headers = {"Inference-Header-Content-Length": value, "Content-Type": "application/octet-stream"}
    async with http.post(served.url("/v2/models/scaled/infer"), data=body, headers=headers) as reply:
        assert reply.status == 400, await reply.text()
        assert "Inference-Header-Content-Length must be a number of bytes" in (await reply.json())["error"]
    headers["Inference-Header-Content-Length"] = str(len(body))
    async with http.post(served.url("/v2/models/scaled/infer"), data=body, headers=headers) as reply:
        assert reply.status == 200, await reply.text()

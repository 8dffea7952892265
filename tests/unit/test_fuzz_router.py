"""Fuzzing the router's `ModelInfer` with real stages (preprocess and postprocess, in-process on 127.0.0.1).

Random model names, versions, input names, datatypes, shapes (huge, negative, empty), byte counts, BYTES
with lying length prefixes, corrupt images, invalid UTF-8, typed contents and parameters. Every case must
be answered OK, INVALID_ARGUMENT or NOT_FOUND within its deadline: never INTERNAL, never a crash or a hang;
and the router must then still serve a good request.

The HTTP/REST side gets the same requests in JSON and binary form, mutated JSON, random bodies, lying
`Inference-Header-Content-Length` headers and broken compression: every answer must be 200, 400, 404 or
413 with an `{"error": ...}` that says something.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import io
import json
import os
import queue
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.datatypes import DATATYPES
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.server import server_options
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import request_for, wait_serving
from tests.stages import example_repository

EXAMPLES = int(os.environ.get("PIPELINE_FUZZ_EXAMPLES", "300"))
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}

ENSEMBLES = """
name: img
stages:
  pre: {{address: "{pre}"}}
inputs: [{{name: IMAGE, datatype: BYTES, shape: [-1, 1]}}]
outputs: [{{name: PIXELS, datatype: FP32, shape: [-1, 1, 8, 8]}}]
steps:
  - {{model_name: digits_preprocess, stage: pre, input_map: {{IMAGE: IMAGE}}, output_map: {{PIXELS: PIXELS}}}}
---
name: txt
stages:
  pre: {{address: "{pre}"}}
inputs: [{{name: TEXT, datatype: BYTES, shape: [-1, 1]}}]
outputs: [{{name: IDS, datatype: INT64, shape: [-1, -1]}}]
steps:
  - {{model_name: embeddings_tokenize, stage: pre, input_map: {{TEXT: TEXT}},
     output_map: {{INPUT_IDS: IDS, ATTENTION_MASK: mask}}}}
---
name: cls
max_batch_size: 8
stages:
  post: {{address: "{post}"}}
inputs: [{{name: LOGITS, datatype: FP32, shape: [-1, 10]}}]
outputs: [{{name: LABEL, datatype: INT64, shape: [-1, 1]}}, {{name: SCORES, datatype: FP32, shape: [-1, 10]}}]
steps:
  - {{model_name: digits_postprocess, stage: post, input_map: {{LOGITS: LOGITS}},
     output_map: {{LABEL: LABEL, SCORES: SCORES}}}}
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """The router (its gRPC and HTTP addresses) and real stages in an event loop of their own
    (hypothesis drives sync clients)."""
    folder: Path = tmp_path_factory.mktemp("fuzz")
    repository = ModelRepository(
        example_repository(
            tmp_path_factory.mktemp("repository"),
            ["digits_preprocess", "embeddings_tokenize", "digits_postprocess"],
            {
                "digits_preprocess": {"max_image_pixels": 512 * 512},
                "embeddings_tokenize": {"max_text_bytes": 256},
            },
        )
    )
    started: queue.Queue[tuple[str, str] | BaseException] = queue.Queue()
    stop = threading.Event()

    async def main() -> None:
        pre_models = ["digits_preprocess", "embeddings_tokenize"]
        backends = [PythonBackend()]
        async with (
            serving_stages([], repository=repository, backends=backends, models=pre_models) as pre,
            serving_stages(
                [], repository=repository, backends=backends, models=["digits_postprocess"]
            ) as post,
        ):
            for i, text in enumerate(ENSEMBLES.split("---\n")):
                (folder / f"e{i}.yaml").write_text(text.format(pre=pre.address, post=post.address))
            async with serving_router(load_ensembles([folder]), max_message_mb=4) as running:
                await wait_serving(running.address, timeout=120)
                assert running.http_address is not None
                started.put((running.address, running.http_address))
                while not stop.is_set():
                    await asyncio.sleep(0.05)

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as err:
            started.put(err)

    thread = threading.Thread(target=run, name="fuzzed-router", daemon=True)
    thread.start()
    addresses = started.get(timeout=180)
    if isinstance(addresses, BaseException):
        raise addresses
    try:
        yield addresses
    finally:
        stop.set()
        thread.join(60)


@pytest.fixture(scope="module")
def router(served: tuple[str, str]) -> str:
    return served[0]


@pytest.fixture(scope="module")
def http_address(served: tuple[str, str]) -> str:
    return served[1]


@pytest.fixture(scope="module")
def stub(router: str) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(router, options=server_options(8 << 20)) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def _png(size: int = 8) -> bytes:
    out = io.BytesIO()
    Image.new("L", (size, size), 200).save(out, format="PNG")
    return out.getvalue()


PNG = _png()
NAMES = ["img", "txt", "cls", "digits_preprocess", "embeddings_tokenize", "digits_postprocess"]
TENSORS = ["IMAGE", "TEXT", "LOGITS", "PIXELS", "INPUT_IDS"]
DIMS = [-(2**63), -5, -1, 0, 1, 2, 3, 10, 2**31, 2**62]


def _bytes_elements(items: list[bytes], lie: int) -> bytes:
    """BYTES in raw form; `lie` added to every length prefix (0: honest)."""
    return b"".join(struct.pack("<I", max(0, min(2**32 - 1, len(i) + lie))) + i for i in items)


elements = st.one_of(
    st.just(PNG),
    st.binary(max_size=64),
    st.binary(max_size=200).map(lambda b: PNG[:16] + b),  # a PNG header and garbage: a corrupt image
    st.binary(min_size=1, max_size=40).map(lambda b: PNG[: len(PNG) // 2] + b),  # a truncated image
    st.sampled_from([b"\xff\xfe\xfa", b"caf\xe9", b"\xed\xa0\x80", b"ok text", b"\x00" * 8]),  # bad UTF-8
)
raw_payloads = st.one_of(
    st.binary(max_size=256),
    st.tuples(st.lists(elements, max_size=4), st.sampled_from([0, 0, 0, -3, 1, 1000, 2**31])).map(
        lambda t: _bytes_elements(*t)
    ),
    st.integers(0, 64).map(lambda n: np.arange(n, dtype=np.float32).tobytes()),
)
parameters = st.dictionaries(
    st.sampled_from(["priority", "timeout", "sequence_id", "x"]) | st.text(max_size=5),
    st.one_of(
        st.integers(-(2**63), 2**63 - 1).map(lambda v: pb.InferParameter(int64_param=v)),
        st.integers(0, 2**64 - 1).map(lambda v: pb.InferParameter(uint64_param=v)),
        st.booleans().map(lambda v: pb.InferParameter(bool_param=v)),
        st.text(max_size=10).map(lambda v: pb.InferParameter(string_param=v)),
        st.floats(allow_nan=True).map(lambda v: pb.InferParameter(double_param=v)),
    ),
    max_size=3,
)


@st.composite
def requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(NAMES) | st.text(max_size=12)),
        model_version=draw(st.sampled_from(["", "", "1", "2", "-1"]) | st.text(max_size=3)),
        id=draw(st.text(max_size=8)),
    )
    raw = draw(st.booleans()) or draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        tensor = request.inputs.add(
            name=draw(st.sampled_from(TENSORS) | st.text(max_size=6)),
            datatype=draw(st.sampled_from([*DATATYPES, "BYTES", "BYTES", "FP8", "", "bytes"])),
            shape=draw(st.lists(st.sampled_from(DIMS) | st.integers(0, 4), max_size=5)),
        )
        if raw:
            request.raw_input_contents.append(draw(raw_payloads))
        else:
            kind = draw(st.sampled_from(["bytes", "int", "fp32", "bool", "uint64"]))
            if kind == "bytes":
                tensor.contents.bytes_contents.extend(draw(st.lists(elements, max_size=4)))
            elif kind == "int":
                tensor.contents.int_contents.extend(
                    draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20))
                )
            elif kind == "fp32":
                tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=20)))
            elif kind == "bool":
                tensor.contents.bool_contents.extend(draw(st.lists(st.booleans(), max_size=20)))
            else:
                tensor.contents.uint64_contents.extend(draw(st.lists(st.integers(0, 2**64 - 1), max_size=20)))
    if draw(st.integers(0, 9)) == 0:
        request.raw_input_contents.append(b"an extra raw content")  # more raw contents than inputs
    for name in draw(st.lists(st.sampled_from(["PIXELS", "IDS", "LABEL", "SCORES", "NOPE"]), max_size=2)):
        request.outputs.add(name=name)
    for key, value in draw(parameters).items():
        request.parameters[key].CopyFrom(value)
    return request


def _good(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    images = np.empty((1, 1), object)
    images[0, 0] = PNG
    reply = stub.ModelInfer(request_for("img", IMAGE=images), timeout=30)
    assert response_tensors(reply)["PIXELS"].shape == (1, 1, 8, 8)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests())
def test_model_infer_never_fails_inside(
    stub: pb_grpc.GRPCInferenceServiceStub, request: pb.ModelInferRequest
) -> None:
    try:
        stub.ModelInfer(request, timeout=20)
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code, details = err.code(), err.details()
        assert code in ALLOWED, f"{code.name}: {details}"
        assert details, "an error must say what was wrong"


def test_model_stream_infer_survives_bad_requests(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    bad = pb.ModelInferRequest(model_name="img")
    bad.inputs.add(name="IMAGE", datatype="BYTES", shape=[1, 1])
    bad.raw_input_contents.append(_bytes_elements([b"not an image"], 7))
    replies = list(stub.ModelStreamInfer(iter([bad, pb.ModelInferRequest(model_name="nope")]), timeout=30))
    assert len(replies) == 2 and all(r.error_message for r in replies)
    assert not any("internal" in r.error_message for r in replies)


def test_huge_images_are_refused_by_their_header(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    images = np.empty((1, 1), object)
    images[0, 0] = _png(3000)  # 9 Mpixel, a few KB
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request_for("img", IMAGE=images), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "IMAGE[0]" in info.value.details()


def test_still_serving_after_the_fuzzing(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    _good(stub)


# --- the HTTP/REST side --------------------------------------------------------------------------------

HTTP_ALLOWED = {200, 400, 404, 413}


def _parameter_json(param: pb.InferParameter) -> object:
    return getattr(param, param.WhichOneof("parameter_choice") or "string_param")


def _rest_form(request: pb.ModelInferRequest, binary: bool) -> tuple[str, bytes, dict[str, str]]:
    """A fuzzed `ModelInferRequest` as a REST request: its raw contents as binary data or as JSON lists."""
    doc: dict = {"id": request.id, "inputs": [], "outputs": [{"name": o.name} for o in request.outputs]}
    doc["parameters"] = {
        k: v
        for k, v in ((k, _parameter_json(p)) for k, p in request.parameters.items())
        if not (isinstance(v, float) and not np.isfinite(v))  # JSON has no NaN or infinity
    }
    blobs = []
    for i, tensor in enumerate(request.inputs):
        entry: dict = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        raw = request.raw_input_contents[i] if i < len(request.raw_input_contents) else b""
        if binary:
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = list(raw[:64])  # numbers of the wrong kind, count or range for most tensors
        doc["inputs"].append(entry)
    text = json.dumps(doc).encode()
    headers = {"Inference-Header-Content-Length": str(len(text))} if binary else {}
    version = f"/versions/{request.model_version}" if request.model_version else ""
    path = f"/v2/models/{request.model_name}{version}/infer"
    return path, text + b"".join(blobs), headers


def _post(address: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", path, body=body, headers=headers)
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def _check_answer(status: int, body: bytes) -> None:
    assert status in HTTP_ALLOWED, f"{status}: {body[:300]!r}"
    if status != 200:
        message = json.loads(body)["error"]
        assert message and "internal" not in message, message


def _quoted(name: str) -> str:
    from urllib.parse import quote

    return quote(name, safe="") or "x"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests(), binary=st.booleans())
def test_http_infer_never_fails_inside(
    http_address: str, request: pb.ModelInferRequest, binary: bool
) -> None:
    request.model_name = _quoted(request.model_name)
    request.model_version = _quoted(request.model_version) if request.model_version else ""
    path, body, headers = _rest_form(request, binary)
    _check_answer(*_post(http_address, path, body, headers))


def _with_surrogate(where: str) -> bytes:
    """Valid JSON with a lone surrogate escaped in place of the string `where`: no UTF-8 string holds it."""
    doc = {"id": "i", "parameters": {"k": 1}}
    doc["inputs"] = [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": ["x"]}]
    return json.dumps(doc).replace(f'"{where}"', '"\\ud800"', 1).encode()


bodies = st.one_of(
    st.binary(max_size=300),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=20,
    ).map(lambda v: json.dumps(v).encode()),
    st.just(b"[" * 100_000),  # nested deeper than any parser's recursion
    st.sampled_from(["i", "k", "TEXT", "BYTES", "x"]).map(_with_surrogate),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=bodies,
    model=st.sampled_from(NAMES),
    header=st.none() | st.integers(-5, 400).map(str) | st.text(max_size=5),
    encoding=st.sampled_from([None, None, "gzip", "deflate", "gzip-lie"]),
)
def test_http_random_bodies_get_a_clear_answer(
    http_address: str, body: bytes, model: str, header: str | None, encoding: str | None
) -> None:
    headers = {}
    if header is not None and header.isascii() and header.isprintable():
        headers["Inference-Header-Content-Length"] = header
    if encoding == "gzip":
        body = gzip.compress(body)
    if encoding is not None:
        headers["Content-Encoding"] = encoding.removesuffix("-lie")  # "gzip-lie": says gzip, is not
    _check_answer(*_post(http_address, f"/v2/models/{model}/infer", body, headers))


def test_http_still_serving_after_the_fuzzing(
    http_address: str, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    text = json.dumps(
        {"inputs": [{"name": "LOGITS", "datatype": "FP32", "shape": [1, 10], "data": [0.0] * 9 + [5.0]}]}
    )
    status, body = _post(http_address, "/v2/models/cls/infer", text.encode(), {})
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [9]
    _good(stub)

"""The router's HTTP/REST side over real HTTP: every endpoint, JSON and binary tensors, compression, the
errors with their HTTP codes, tracing, metrics and statistics shared with gRPC, tokens and TLS."""

from __future__ import annotations

import asyncio
import gzip
import json
import ssl
import zlib
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import Tensor
from pipeline.protocol.types import TensorSpec
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, wait_serving
from tests.integration.test_security import certs  # noqa: F401 - a fixture
from tests.integration.test_telemetry import Traced
from tests.stages import Scale

HEADER = "Inference-Header-Content-Length"


class Shout(Stage):
    """TEXT (BYTES) upper-cased, and each element's length."""

    name = "shout"
    max_batch_size = 8
    inputs = (TensorSpec("TEXT", "BYTES", (-1, 1)),)
    outputs = (TensorSpec("UPPER", "BYTES", (-1, 1)), TensorSpec("LENGTH", "INT64", (-1, 1)))

    def infer(self, inputs):
        text = inputs["TEXT"]
        upper = np.vectorize(lambda b: b.upper(), otypes=[object])(text)
        return {"UPPER": upper, "LENGTH": np.vectorize(len, otypes=[np.int64])(text)}


ENSEMBLES = """
name: scaled
stages:
  a: {{address: "{a}", dynamic_batching: {{max_batch_size: 8}}}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: scale, stage: a, input_map: {{X: X}}, output_map: {{Y: Y}}}}
---
name: shouted
stages:
  b: {{address: "{b}"}}
inputs: [{{name: TEXT, datatype: BYTES, shape: [-1, 1]}}]
outputs: [{{name: UPPER, datatype: BYTES, shape: [-1, 1]}}, {{name: LENGTH, datatype: INT64, shape: [-1, 1]}}]
steps:
  - {{model_name: shout, stage: b, input_map: {{TEXT: TEXT}}, output_map: {{UPPER: UPPER, LENGTH: LENGTH}}}}
---
name: together
stages:
  c:
    address: "{c}"
    dynamic_batching: {{max_batch_size: 3, max_queue_delay_microseconds: 30000000, idle_dispatch: false}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}]
steps:
  - {{model_name: scale3, stage: c, input_map: {{X: X}}, output_map: {{Y: Y}}}}
"""

MAX_MESSAGE_MB = 1


class Served:
    def __init__(self, grpc_address: str, http: str, traced: Traced) -> None:
        self.grpc, self.http, self.traced = grpc_address, http, traced

    def url(self, path: str) -> str:
        return f"http://{self.http}{path}"


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    traced = Traced("pipeline-router")
    async with (
        serving_stages([Scale()]) as a,
        serving_stages([Shout()]) as b,
        serving_stages([Scale("scale3", max_batch_size=3)]) as c,
    ):
        folder = tmp_path_factory.mktemp("http")
        for i, text in enumerate(ENSEMBLES.split("---\n")):
            (folder / f"e{i}.yaml").write_text(text.format(a=a.address, b=b.address, c=c.address))
        async with serving_router(
            load_ensembles([folder]),
            max_message_mb=MAX_MESSAGE_MB,
            telemetry=traced.telemetry,
            metrics=traced.metrics,
        ) as router:
            await wait_serving(router.address)
            assert router.http_address is not None
            yield Served(router.address, router.http_address, traced)


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(auto_decompress=True) as session:
        yield session


X = np.array([[1, 2, 3], [4, 5, 6]], np.float32)


def binary_body(header: dict, *raws: bytes) -> tuple[bytes, dict[str, str]]:
    """A request in Triton's binary tensor data form: the JSON header, then the raw inputs."""
    text = json.dumps(header).encode()
    return text + b"".join(raws), {HEADER: str(len(text)), "Content-Type": "application/octet-stream"}


def split_binary(body: bytes, header_length: str | None) -> tuple[dict, dict[str, bytes]]:
    """A binary response's JSON and each binary output's bytes, by name."""
    if header_length is None:
        return json.loads(body), {}
    doc = json.loads(body[: int(header_length)])
    offset, raws = int(header_length), {}
    for out in doc["outputs"]:
        size = out.get("parameters", {}).get("binary_data_size")
        if size is not None:
            raws[out["name"]] = body[offset : offset + size]
            offset += size
    assert offset == len(body)
    return doc, raws


async def good_request(served: Served, http: aiohttp.ClientSession) -> None:
    """The router still answers a good request (after a bad one)."""
    request = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    async with http.post(served.url("/v2/models/scaled/infer"), json=request) as reply:
        assert reply.status == 200, await reply.text()
        assert (await reply.json())["outputs"][0]["data"] == [2, 4, 6]


# --- endpoints -----------------------------------------------------------------------------------------


async def test_health_and_metadata_endpoints(served, http):
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/scaled/ready", "/v2/models/scale/ready"):
        async with http.get(served.url(path)) as reply:
            assert reply.status == 200, path
    async with http.get(served.url("/v2/models/nope/ready")) as reply:
        assert reply.status == 400  # the protocol's "false"
    async with http.get(served.url("/v2")) as reply:
        meta = await reply.json()
        assert meta["name"] == "pipeline-router"
        assert {"binary_tensor_data", "statistics", "model_configuration"} <= set(meta["extensions"])
    for path in ("/v2/models/scaled", "/v2/models/scaled/versions/1"):
        async with http.get(served.url(path)) as reply:
            assert reply.status == 200
            assert await reply.json() == {
                "name": "scaled",
                "versions": ["1"],
                "platform": "ensemble",
                "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, 3]}],
                "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 3]}],
            }
    async with http.get(served.url("/v2/models/shout")) as reply:  # a stage model, forwarded
        assert [t["name"] for t in (await reply.json())["outputs"]] == ["UPPER", "LENGTH"]
    async with http.get(served.url("/v2/models/scaled/versions/7")) as reply:
        assert reply.status == 404 and "version '7'" in (await reply.json())["error"]


async def test_config_and_statistics_as_triton_writes_them(served, http):
    async with http.get(served.url("/v2/models/scaled/config")) as reply:
        config = await reply.json()
    assert config["platform"] == "ensemble"
    assert config["input"][0]["dims"] == [3]  # numbers, as Triton writes them, not proto3's strings
    assert config["ensemble_scheduling"]["step"][0]["model_name"] == "scale"
    async with http.get(served.url("/v2/models/scale/config")) as reply:
        assert (await reply.json())["max_batch_size"] == 32

    async with http.get(served.url("/v2/models/scaled/stats")) as reply:
        before = (await reply.json())["model_stats"][0]
    await good_request(served, http)
    async with http.get(served.url("/v2/models/scaled/versions/1/stats")) as reply:
        after = (await reply.json())["model_stats"][0]
    assert after["name"] == "scaled"
    assert after.get("inference_count", 0) == before.get("inference_count", 0) + 1
    assert isinstance(after["inference_stats"]["success"]["count"], int)
    async with http.get(served.url("/v2/models/stats")) as reply:
        names = {m["name"] for m in (await reply.json())["model_stats"]}
    assert {"scaled", "shouted", "scale", "shout"} <= names


async def test_repository_endpoints_answer_as_grpc_does(served, http):
    # The router lists its ensembles and its stages' models; loads and unloads are closed by default (gRPC:
    # FAILED_PRECONDITION).
    async with http.post(served.url("/v2/repository/index"), json={}) as reply:
        assert reply.status == 200
        names = {m["name"] for m in await reply.json()}
    assert {"scaled", "shouted"} <= names
    for path in ("/v2/repository/models/scaled/load", "/v2/repository/models/scaled/unload"):
        async with http.post(served.url(path), json={}) as reply:
            assert reply.status == 400
            assert "is not allowed" in (await reply.json())["error"]


# --- inference -----------------------------------------------------------------------------------------


async def test_json_tensors_nested_or_flat(served, http):
    for data in (X.tolist(), X.reshape(-1).tolist()):
        request = {
            "id": "r-1",
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 3], "data": data}],
            "outputs": [{"name": "Y"}],
        }
        async with http.post(served.url("/v2/models/scaled/infer"), json=request) as reply:
            assert reply.status == 200
            assert reply.content_type == "application/json" and HEADER not in reply.headers
            doc = await reply.json()
    assert doc["id"] == "r-1" and doc["model_name"] == "scaled" and doc["model_version"] == "1"
    assert doc["outputs"] == [
        {"name": "Y", "datatype": "FP32", "shape": [2, 3], "data": (X * 2).reshape(-1).tolist()}
    ]


async def test_binary_tensors_in_and_out(served, http):
    header = {
        "inputs": [
            {"name": "X", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}}
        ],
        "outputs": [{"name": "Y", "parameters": {"binary_data": True}}],
    }
    body, headers = binary_body(header, X.tobytes())
    async with http.post(
        served.url("/v2/models/scaled/versions/1/infer"), data=body, headers=headers
    ) as reply:
        assert reply.status == 200, await reply.text()
        doc, raws = split_binary(await reply.read(), reply.headers.get(HEADER))
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 24}
    np.testing.assert_array_equal(np.frombuffer(raws["Y"], np.float32).reshape(2, 3), X * 2)


async def test_bytes_tensors_as_json_and_as_binary(served, http):
    words = ["héllo", "wörld"]
    request = {
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2, 1], "data": [[w] for w in words]}],
        "parameters": {"binary_data_output": True},
        "outputs": [{"name": "UPPER", "parameters": {"binary_data": False}}, {"name": "LENGTH"}],
    }
    async with http.post(served.url("/v2/models/shouted/infer"), json=request) as reply:
        doc, raws = split_binary(await reply.read(), reply.headers.get(HEADER))
    upper, _ = doc["outputs"]
    assert upper["data"] == [w.encode().upper().decode() for w in words]  # JSON, as asked for this output
    lengths = np.frombuffer(raws["LENGTH"], np.int64)  # binary, as binary_data_output says for the rest
    assert lengths.tolist() == [len(w.encode()) for w in words]

    elements = np.array([[b"\xff\x00raw"], [b"abc"]], dtype=object)  # not UTF-8: only binary can carry it
    raw = Tensor.from_array("TEXT", elements).raw
    header = {
        "inputs": [
            {
                "name": "TEXT",
                "datatype": "BYTES",
                "shape": [2, 1],
                "parameters": {"binary_data_size": len(raw)},
            }
        ],
        "outputs": [{"name": "UPPER", "parameters": {"binary_data": True}}],
    }
    body, headers = binary_body(header, raw)
    async with http.post(served.url("/v2/models/shouted/infer"), data=body, headers=headers) as reply:
        doc, raws = split_binary(await reply.read(), reply.headers.get(HEADER))
    assert [o["name"] for o in doc["outputs"]] == ["UPPER"]
    assert raws["UPPER"] == Tensor.from_array("UPPER", np.array([[b"\xff\x00RAW"], [b"ABC"]], object)).raw
    # The same output asked for as JSON cannot be written as text: a 400 that says what to do.
    header["outputs"][0]["parameters"]["binary_data"] = False
    body, headers = binary_body(header, raw)
    async with http.post(served.url("/v2/models/shouted/infer"), data=body, headers=headers) as reply:
        assert reply.status == 400 and "binary_data" in (await reply.json())["error"]


async def test_compressed_requests_and_responses(served, http):
    request = json.dumps(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 3], "data": X.tolist()}]}
    ).encode()
    for encoding, packed in (("gzip", gzip.compress(request)), ("deflate", zlib.compress(request))):
        headers = {
            "Content-Encoding": encoding,
            "Content-Type": "application/json",
            "Accept-Encoding": encoding,
        }
        async with http.post(served.url("/v2/models/scaled/infer"), data=packed, headers=headers) as reply:
            assert reply.status == 200, await reply.text()
            assert reply.headers["Content-Encoding"] == encoding  # the response is compressed too
            assert (await reply.json())["outputs"][0]["data"] == (X * 2).reshape(-1).tolist()
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with http.post(
        served.url("/v2/models/scaled/infer"), data=b"\x1f\x8bnot gzip", headers=headers
    ) as reply:
        assert reply.status == 400 and "Content-Encoding gzip" in (await reply.json())["error"]
    # A small body that inflates beyond the size limit is stopped at the limit.
    bomb = gzip.compress(b"{" + b" " * (MAX_MESSAGE_MB << 20) + b"}")
    async with http.post(served.url("/v2/models/scaled/infer"), data=bomb, headers=headers) as reply:
        assert reply.status == 413 and "larger than this server accepts" in (await reply.json())["error"]
    headers["Content-Encoding"] = "zstd"
    async with http.post(served.url("/v2/models/scaled/infer"), data=request, headers=headers) as reply:
        assert reply.status == 400 and "'zstd' is not supported" in (await reply.json())["error"]
    await good_request(served, http)


async def test_requests_are_batched_with_the_grpc_ones(served, http):
    # `together` sends only full batches of 3: two HTTP requests and one gRPC request make one.
    def body(value: float) -> dict:
        return {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [value] * 3}]}

    async def over_http(value: float) -> list[float]:
        async with http.post(served.url("/v2/models/together/infer"), json=body(value)) as reply:
            return (await reply.json())["outputs"][0]["data"]

    async with inference_stub(served.grpc) as stub:
        results = await asyncio.gather(
            over_http(1),
            over_http(2),
            stub.ModelInfer(request_for("together", X=np.full((1, 3), 3, np.float32)), timeout=30),
        )
    assert results[0] == [2] * 3 and results[1] == [4] * 3
    async with http.get(served.url("/v2/models/scale3/stats")) as reply:
        stats = (await reply.json())["model_stats"][0]
    assert stats["execution_count"] == 1 and stats["inference_count"] == 3
    assert stats["batch_stats"][0]["batch_size"] == 3


# --- errors --------------------------------------------------------------------------------------------

FP32_INPUT = {"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "words"),
    [
        ("/v2/models/scaled/infer", b'{"inputs": [', {}, 400, "not valid JSON"),
        ("/v2/models/scaled/infer", b"[1, 2]", {}, 400, "must be a JSON object"),
        ("/v2/models/scaled/infer", b"\xff\xfe", {}, 400, "not valid JSON"),
        ("/v2/models/scaled/infer", b"{}", {}, 400, "no 'inputs'"),
        ("/v2/models/nope/infer", {"inputs": [FP32_INPUT]}, {}, 404, "unknown model 'nope'"),
        (
            "/v2/models/scaled/infer",
            {"inputs": [{**FP32_INPUT, "datatype": "INT32"}]},
            {},
            400,
            "expected datatype FP32, got INT32",
        ),
        (
            "/v2/models/scaled/infer",
            {"inputs": [{**FP32_INPUT, "shape": [3]}]},
            {},
            400,
            "expected shape [-1, 3], got [3]",
        ),
        (
            "/v2/models/scaled/infer",
            {"inputs": [{**FP32_INPUT, "shape": [2, 3]}]},
            {},
            400,
            "needs 6 elements",
        ),
        (
            "/v2/models/scaled/infer",
            {"inputs": [{**FP32_INPUT, "data": ["a", "b", "c"]}]},
            {},
            400,
            "numbers",
        ),
        (
            "/v2/models/scaled/infer",
            {"inputs": [{**FP32_INPUT, "datatype": "FP8"}]},
            {},
            400,
            "unknown datatype 'FP8'",
        ),
        (
            "/v2/models/scaled/infer",
            {"inputs": [{**FP32_INPUT, "shape": [1, -3]}]},
            {},
            400,
            "negative dimension",
        ),
        (
            "/v2/models/scaled/infer",
            {"inputs": [{**FP32_INPUT, "data": [-1, 2, 3]}]},
            {},
            400,
            "X[0]: negative",
        ),
        (
            "/v2/models/scaled/infer",
            {"inputs": [{**FP32_INPUT, "name": "Z"}]},
            {},
            400,
            "unexpected input 'Z'",
        ),
        (
            "/v2/models/scaled/infer",
            {"inputs": [FP32_INPUT], "outputs": [{"name": "NO"}]},
            {},
            400,
            "no output(s) NO",
        ),
        # Binary data whose lengths disagree with the header
        ("/v2/models/scaled/infer", {"inputs": [FP32_INPUT]}, {HEADER: "100000"}, 400, HEADER),
        ("/v2/models/scaled/infer", {"inputs": [FP32_INPUT]}, {HEADER: "ten"}, 400, HEADER),
        ("/v2/models/scaled/infer", b"", {}, 400, "no 'inputs'"),
        ("/v2/models/scaled/infer", b'{"id": "\\ud800", "inputs": []}', {}, 400, "not valid Unicode"),
        # Found by `make fuzz`: no elements, in a shape too large for numpy (was INTERNAL).
        (
            "/v2/models/shouted/infer",
            {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [0, 2**62], "data": []}]},
            {},
            400,
            "shape [0, 4611686018427387904] cannot be held",
        ),
        (
            "/v2/models/shouted/infer",
            b'{"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": ["\\udfff"]}]}',
            {},
            400,
            "not valid Unicode",
        ),
    ],
)
async def test_bad_requests_get_a_4xx_naming_the_problem(served, http, path, body, headers, status, words):
    kwargs = {"json": body} if isinstance(body, dict) else {"data": body}
    async with http.post(served.url(path), headers=headers, **kwargs) as reply:
        assert reply.status == status, await reply.text()
        assert reply.content_type == "application/json"
        message = (await reply.json())["error"]
    assert words in message
    await good_request(served, http)


async def test_binary_sizes_that_do_not_add_up(served, http):
    header = {
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3], "parameters": {"binary_data_size": 12}}]
    }
    for extra, words in ((b"", "binary_data_size 12"), (b"\0" * 16, "add up to 12")):
        body, headers = binary_body(header, extra)
        async with http.post(served.url("/v2/models/scaled/infer"), data=body, headers=headers) as reply:
            assert reply.status == 400
            assert words in (await reply.json())["error"]
    # A binary size that is honest but wrong for the shape: the same check as gRPC's raw contents.
    header["inputs"][0]["parameters"]["binary_data_size"] = 8
    body, headers = binary_body(header, b"\0" * 8)
    async with http.post(served.url("/v2/models/scaled/infer"), data=body, headers=headers) as reply:
        assert reply.status == 400 and "needs 12 bytes, got 8" in (await reply.json())["error"]
    await good_request(served, http)


async def test_a_body_over_the_limit_is_refused_with_413(served, http):
    body = b"{" + b" " * (MAX_MESSAGE_MB << 20) + b"}"
    async with http.post(served.url("/v2/models/scaled/infer"), data=body) as reply:
        assert reply.status == 413
        assert "larger than this server accepts" in (await reply.json())["error"]
    await good_request(served, http)


async def test_unknown_paths_and_methods_answer_in_json(served, http):
    async with http.get(served.url("/v2/nothing/here")) as reply:
        assert reply.status == 404 and "/v2/nothing/here" in (await reply.json())["error"]
    async with http.get(served.url("/v2/models/scaled/infer")) as reply:
        assert reply.status == 405 and "error" in await reply.json()


# --- tracing and metrics -------------------------------------------------------------------------------


async def test_a_traceparent_header_is_continued(served, http):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    served.traced.exporter.clear()
    request = {"inputs": [FP32_INPUT]}
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    async with http.post(served.url("/v2/models/scaled/infer"), json=request, headers=headers) as reply:
        assert reply.status == 200
    [root] = [
        s for s in served.traced.spans() if s.name == "ModelInfer scaled" and s.parent and s.parent.is_remote
    ]
    assert f"{root.context.trace_id:032x}" == trace_id and f"{root.parent.span_id:016x}" == parent_id


async def test_metrics_count_http_requests_by_outcome(served, http):
    registry = served.traced.metrics.registry

    def count(outcome: str) -> float:
        return (
            registry.get_sample_value("pipeline_requests_total", {"model": "scaled", "outcome": outcome}) or 0
        )

    ok, invalid = count("OK"), count("INVALID_ARGUMENT")
    await good_request(served, http)
    async with http.post(
        served.url("/v2/models/scaled/infer"), json={"inputs": [{**FP32_INPUT, "shape": [3]}]}
    ):
        pass
    assert count("OK") == ok + 1 and count("INVALID_ARGUMENT") == invalid + 1


# --- tokens and TLS ------------------------------------------------------------------------------------


async def test_bearer_tokens_over_http(tmp_path, monkeypatch, http):
    monkeypatch.setenv("PIPELINE_AUTH_TOKENS", "reader-token")
    monkeypatch.setenv("PIPELINE_ADMIN_TOKENS", "admin-token")
    # The stage, in this environment too, asks for a token: the router's, which both read here.
    monkeypatch.setenv("PIPELINE_STAGE_TOKEN", "router-token")
    async with serving_stages([Scale()]) as stage:
        (tmp_path / "e.yaml").write_text(ENSEMBLES.split("---\n")[0].format(a=stage.address))
        async with serving_router(load_ensembles([tmp_path])) as router:
            await wait_serving(router.address)
            base = f"http://{router.http_address}"
            for path in ("/v2/health/live", "/v2/health/ready"):  # probes need no token
                async with http.get(base + path) as reply:
                    assert reply.status == 200
            request = {"inputs": [FP32_INPUT]}
            for auth in (None, "Bearer wrong", "reader-token", "Basic reader-token"):
                headers = {"Authorization": auth} if auth else {}
                async with http.post(
                    base + "/v2/models/scaled/infer", json=request, headers=headers
                ) as reply:
                    assert reply.status == 401
                    assert "Bearer" in (await reply.json())["error"]
                async with http.get(base + "/v2", headers=headers) as reply:
                    assert reply.status == 401
            reader = {"Authorization": "Bearer reader-token"}
            admin = {"Authorization": "Bearer admin-token"}
            for headers in (reader, admin):
                async with http.post(
                    base + "/v2/models/scaled/infer", json=request, headers=headers
                ) as reply:
                    assert reply.status == 200
            async with http.post(base + "/v2/repository/models/scaled/unload", headers=reader) as reply:
                assert reply.status == 403 and "admin" in (await reply.json())["error"]
            async with http.post(base + "/v2/repository/models/scaled/unload", headers=admin) as reply:
                # Allowed; an ensemble is not unloaded through the repository API (its models are).
                assert reply.status == 400 and "is an ensemble" in (await reply.json())["error"]


def _client_ssl(folder: Path, *, client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(folder / "ca.pem"))
    if client_cert:
        context.load_cert_chain(str(folder / "client.pem"), str(folder / "client-key.pem"))
    return context


async def test_https_with_the_routers_certificate_and_mutual_tls(certs, tmp_path, http):  # noqa: F811
    server = {"tls_cert": str(certs / "server.pem"), "tls_key": str(certs / "server-key.pem")}
    async with serving_stages([Scale()]) as stage:
        (tmp_path / "e.yaml").write_text(ENSEMBLES.split("---\n")[0].format(a=stage.address))
        for options, needs_cert in ((server, False), ({**server, "tls_ca": str(certs / "ca.pem")}, True)):
            async with serving_router(load_ensembles([tmp_path]), options=options) as router:
                url = f"https://{router.http_address}/v2/models/scaled/infer"
                request = {"inputs": [FP32_INPUT]}
                with pytest.raises(aiohttp.ClientError):  # no plaintext
                    async with http.post(url.replace("https:", "http:"), json=request) as reply:
                        await reply.read()
                if needs_cert:
                    with pytest.raises(aiohttp.ClientError):
                        async with http.post(
                            url, json=request, ssl=_client_ssl(certs, client_cert=False)
                        ) as r:
                            await r.read()
                context = _client_ssl(certs, client_cert=True)
                async with http.post(url, json=request, ssl=context) as reply:
                    assert reply.status == 200
                    assert (await reply.json())["outputs"][0]["data"] == [2, 4, 6]


def test_the_error_table_covers_every_status():
    import grpc

    from pipeline.router.frontdoor.http import HTTP_STATUS

    assert set(HTTP_STATUS) == set(grpc.StatusCode)
    assert HTTP_STATUS[grpc.StatusCode.INTERNAL] == 500 and HTTP_STATUS[grpc.StatusCode.NOT_FOUND] == 404


# --- pipeline bench over HTTP --------------------------------------------------------------------------


async def test_bench_drives_the_http_side(served):
    from pipeline.tools.bench.options import BenchError, BenchOptions
    from pipeline.tools.bench.run import run_bench

    options = BenchOptions(
        # `shouted`: any random bytes are good input (`scaled` refuses negative numbers)
        url=served.http,
        model="shouted",
        protocol="http",
        concurrency=(1, 3),
        warmup=0.2,
        duration=1.5,  # long enough that the statistics read before and after it straddle calls
    )
    options.progress = False
    report = await run_bench(options)
    assert report.statistics  # read over HTTP too
    for result in report.results:
        assert result.ok > 0 and not result.errors
        assert result.stages is not None and result.stages["shouted"]["inference_count"] > 0
    with pytest.raises(BenchError, match="HTTP_404"):
        await run_bench(BenchOptions(url=served.http, model="nope", protocol="http", progress=False))

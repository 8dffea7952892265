"""`pipeline bench` against real in-process stage servers: counts, errors by code, JSON and the plot.

Intervals are short and nothing asserts on timing: the machine is shared and noisy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import InvalidInput
from pipeline.protocol.types import TensorSpec
from pipeline.stage.api import Stage
from pipeline.tools.bench.command import parse_shape
from pipeline.tools.bench.options import BenchError, BenchOptions
from pipeline.tools.bench.payloads import build_request, synthesize_inputs
from pipeline.tools.bench.report import format_report, write_json, write_plot
from pipeline.tools.bench.run import run_bench
from pipeline.tools.bench.statistics import statistics_delta
from pipeline.tools.testing import serving_stages
from tests.conftest import wait_serving
from tests.streaming import serving_writer


class Double(Stage):
    name = "double"
    max_batch_size = 16
    inputs = (TensorSpec("X", "FP32", (-1, 4)), TensorSpec("TAG", "BYTES", (-1, 1)))
    outputs = (TensorSpec("Y", "FP32", (-1, 4)),)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"Y": inputs["X"] * 2}


class Refuse(Stage):
    name = "refuse"
    max_batch_size = 16
    inputs = (TensorSpec("X", "UINT8", (-1, 3)),)
    outputs = (TensorSpec("Y", "UINT8", (-1, 3)),)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise InvalidInput("X[0]: refused, always")


@pytest.fixture
async def server():
    async with serving_stages([Double(), Refuse()]) as running:
        await wait_serving(running.address)
        yield running


def _options(address: str, model: str, **kwargs) -> BenchOptions:
    return BenchOptions(
        **{"url": address, "model": model, "warmup": 0.2, "duration": 0.6, "progress": False, **kwargs}
    )


async def test_closed_loop_counts_every_request_once(server) -> None:
    report = await run_bench(_options(server.address, "double", concurrency=(1, 4), batch=3))

    assert [r.level.value for r in report.results] == [1, 4]
    for r in report.results:
        assert r.sent > 0
        assert r.sent == r.ok == r.responses
        assert not r.errors and not r.window_errors
        assert 0 < r.window_ok <= r.ok
        assert r.latencies.size == r.window_ok and (r.latencies > 0).all()
        assert r.infer_per_s == pytest.approx(3 * r.requests_per_s)
    assert report.inputs == [
        {"name": "X", "datatype": "FP32", "shape": [3, 4]},
        {"name": "TAG", "datatype": "BYTES", "shape": [3, 1]},
    ]
    # Server-side figures where the server lists `statistics`; the client's own figures only elsewhere.
    if report.statistics:
        for r in report.results:
            assert r.stages is not None or r.stages_error
            if r.stages is not None:
                # The server's time for a request is part of what the client waited for it.
                served = r.stages["double"]["request_us"]
                client, outside = r.outside_server_us("double")
                assert 0 < served < client and outside == pytest.approx(client - served)
        text = format_report(report)
        assert "server statistics over the measured interval" in text
        assert "us outside the server's request time" in text
    else:
        assert all(r.stages is None for r in report.results)
        assert "client-side figures only" in format_report(report)


async def test_rejections_are_counted_by_status_code(server) -> None:
    # 1.5 s: a window that calls still land in when the machine stalls for part of it.
    report = await run_bench(_options(server.address, "refuse", concurrency=(2,), duration=1.5))

    (r,) = report.results
    assert r.sent > 0 and r.ok == 0
    assert dict(r.errors) == {"INVALID_ARGUMENT": r.sent}
    assert r.window_errors["INVALID_ARGUMENT"] > 0 and r.latencies.size == 0
    assert "INVALID_ARGUMENT" in format_report(report)


@pytest.mark.parametrize("arrival", ["poisson", "constant"])
async def test_open_loop_counts_every_request_once(server, arrival: str) -> None:
    report = await run_bench(_options(server.address, "double", rates=(200.0,), arrival=arrival))

    (r,) = report.results
    assert r.level.kind == "rate" and r.sent > 0 and r.dropped == 0
    assert r.sent == r.ok == r.responses


async def test_several_processes_share_the_load(server) -> None:
    report = await run_bench(_options(server.address, "double", concurrency=(3,), processes=2))

    (r,) = report.results
    assert r.sent > 0 and r.sent == r.ok and not r.errors


async def test_json_and_plot_are_written(server, tmp_path: Path) -> None:
    report = await run_bench(_options(server.address, "double", concurrency=(1, 2)))
    write_json(report, tmp_path / "out.json")
    data = json.loads((tmp_path / "out.json").read_text())

    assert {"tool", "url", "model", "mode", "batch", "server", "inputs", "results"} <= data.keys()
    assert data["mode"] == "concurrency" and [r["concurrency"] for r in data["results"]] == [1, 2]
    for result in data["results"]:
        assert {
            "sent",
            "responses",
            "ok",
            "errors",
            "window",
            "throughput_infer_per_s",
            "throughput_requests_per_s",
            "latency_ms",
            "stages",
        } <= result.keys()
        assert {"p50", "p90", "p99"} <= result["latency_ms"].keys()
        assert result["sent"] == result["responses"]

    pytest.importorskip("matplotlib")
    from PIL import Image

    write_plot(report, tmp_path / "out.png")
    with Image.open(tmp_path / "out.png") as image:
        image.load()
        assert image.format == "PNG" and image.width > 100 and image.height > 100


async def test_an_unknown_model_is_a_clear_error(server) -> None:
    with pytest.raises(BenchError, match="NOT_FOUND"):
        await run_bench(_options(server.address, "nope"))


def test_inputs_follow_the_metadata_and_the_shape_flags(tmp_path: Path) -> None:
    meta = pb.ModelMetadataResponse(
        name="m",
        inputs=[
            pb.ModelMetadataResponse.TensorMetadata(name="A", datatype="INT8", shape=[-1, -1, 2]),
            pb.ModelMetadataResponse.TensorMetadata(name="B", datatype="BYTES", shape=[-1]),
            pb.ModelMetadataResponse.TensorMetadata(name="C", datatype="BF16", shape=[2]),
        ],
    )
    (tmp_path / "b.bin").write_bytes(b"hello")
    arrays = synthesize_inputs(
        meta, batching=True, batch=5, shapes={"A": (7, 2)}, files={"B": tmp_path / "b.bin"}
    )
    assert arrays["A"].shape == (5, 7, 2) and arrays["A"].dtype == np.int8
    assert arrays["B"].shape == (5,) and list(arrays["B"]) == [b"hello"] * 5
    assert arrays["C"].shape == (5,)  # batching: dim 0 is the batch whatever the metadata says
    request = build_request("m", "", arrays)
    assert [t.name for t in request.inputs] == ["A", "B", "C"] and len(request.raw_input_contents) == 3

    with pytest.raises(BenchError, match="--shape A"):
        synthesize_inputs(meta, batching=True)
    with pytest.raises(BenchError, match="no input 'Z'"):
        synthesize_inputs(meta, batching=True, shapes={"Z": (1,)})
    assert parse_shape("A=7,2") == ("A", (7, 2))
    with pytest.raises(BenchError):
        parse_shape("A=")


def test_bytes_inputs_from_npy_files_are_read_without_pickle(tmp_path: Path) -> None:
    meta = pb.ModelMetadataResponse(
        name="m", inputs=[pb.ModelMetadataResponse.TensorMetadata(name="B", datatype="BYTES", shape=[-1])]
    )
    np.save(tmp_path / "bytes.npy", np.array([b"ab", b"c"]))
    np.save(tmp_path / "text.npy", np.array(["é", "xyz"]))
    for name, expected in (("bytes.npy", [b"ab", b"c"]), ("text.npy", ["é".encode(), b"xyz"])):
        arrays = synthesize_inputs(meta, batching=True, files={"B": tmp_path / name})
        assert arrays["B"].dtype == object and list(arrays["B"]) == expected
    # A pickled object array is refused, not unpickled.
    np.save(tmp_path / "objects.npy", np.array([b"x", 1], dtype=object))  # np.save pickles objects
    with pytest.raises(BenchError, match="byte strings"):
        synthesize_inputs(meta, batching=True, files={"B": tmp_path / "objects.npy"})


def test_statistics_deltas_give_perf_analyzers_figures() -> None:
    def stats(inferences: int, executions: int, queue_ns: int, infer_ns: int, b8: int) -> pb.ModelStatistics:
        s = pb.ModelStatistics(name="m", version="1", inference_count=inferences, execution_count=executions)
        s.inference_stats.success.count = inferences
        s.inference_stats.success.ns = 2 * infer_ns
        s.inference_stats.queue.count = inferences
        s.inference_stats.queue.ns = queue_ns
        s.inference_stats.compute_infer.count = inferences
        s.inference_stats.compute_infer.ns = infer_ns
        s.batch_stats.add(batch_size=8).compute_infer.count = b8
        return s

    before = {"m": stats(10, 10, 10_000, 50_000, 0), "idle": pb.ModelStatistics(name="idle")}
    after = {"m": stats(90, 20, 90_000, 450_000, 10), "idle": pb.ModelStatistics(name="idle")}
    delta = statistics_delta(before, after)

    assert list(delta) == ["m"]  # models that did nothing are left out
    m = delta["m"]
    assert m["inference_count"] == 80 and m["execution_count"] == 10
    assert m["mean_batch_size"] == 8.0 and m["batch_sizes"] == {8: 10}
    assert m["queue_us"] == pytest.approx(1.0) and m["compute_infer_us"] == pytest.approx(5.0)
    assert m["request_us"] == pytest.approx(10.0)


async def test_cpu_per_request_is_read_from_each_process_metrics() -> None:
    from pipeline.runtime.metrics import Metrics

    metrics = Metrics()
    async with serving_stages([Double()], metrics=metrics, metrics_port=0) as running:
        await wait_serving(running.address)
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        options = _options(
            running.address,
            "double",
            concurrency=(2,),
            cpu_metrics={"stage": url, "gone": "http://127.0.0.1:9/metrics"},
        )
        report = await run_bench(options)
    (result,) = report.results
    per = result.cpu_us_per_request()
    # This test's process is the server: its CPU over the interval, shared out over the requests.
    assert per["stage"] is not None and per["stage"] > 0
    assert per["gone"] is None and per["all"] is None, "a process that cannot be read leaves the sum unknown"
    assert report.to_dict()["results"][0]["cpu_us_per_request"]["stage"] == per["stage"]
    assert "CPU per request" in format_report(report) and "gone - us" in format_report(report)


class Cached(Stage):
    """A model the router caches: counts the requests that reach it."""

    name = "cached_double"
    max_batch_size = 16
    response_cache = True
    inputs = (TensorSpec("X", "FP32", (-1, 4)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 4)),)

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self.calls = 0

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls += 1
        self.seen.add(inputs["X"].tobytes())
        return {"Y": inputs["X"] * 2}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_repeat_share_mixes_one_repeated_input_with_unique_ones(protocol: str, tmp_path: Path) -> None:
    from pipeline.ensemble.catalog import load_ensembles
    from pipeline.tools.testing import serving_router

    stage = Cached()
    async with serving_stages([stage]) as running:
        await wait_serving(running.address)
        (tmp_path / "e.yaml").write_text(
            f"name: e\nstages: {{s: {{address: '{running.address}'}}}}\n"
            "inputs: [{name: X, datatype: FP32, shape: [-1, 4]}]\n"
            "outputs: [{name: Y, datatype: FP32, shape: [-1, 4]}]\n"
            "steps: [{model_name: cached_double, stage: s, input_map: {X: X}, output_map: {Y: Y}}]\n"
        )
        async with serving_router(load_ensembles(tmp_path), options={"cache_size": 1 << 20}) as router:
            await wait_serving(router.address)
            url = router.address if protocol == "grpc" else router.http_address
            report = await run_bench(
                _options(url, "cached_double", protocol=protocol, concurrency=(2,), repeat_share=0.5)
            )
    result = report.results[0]
    assert result.ok == result.sent > 10 and not result.errors
    # Every input reached the stage once: the unique ones, and the repeated one the first time only.
    assert len(stage.seen) == stage.calls
    assert 0 < stage.calls < result.ok
    stats = result.stages["cached_double"]
    assert stats["cache_hits"] > 0 and stats["cache_misses"] > 0
    assert "repeated inputs" in format_report(report)


async def test_input_files_given_several_times_are_sent_in_turn(server, tmp_path: Path) -> None:
    for name, value in (("a.npy", 1.0), ("b.npy", 2.0)):
        np.save(tmp_path / name, np.full((1, 4), value, np.float32))
    (tmp_path / "tag").write_bytes(b"t")
    files = {"X": [tmp_path / "a.npy", tmp_path / "b.npy"], "TAG": [tmp_path / "tag"]}
    report = await run_bench(_options(server.address, "double", input_files=files))
    assert report.results[0].ok > 1
    with pytest.raises(BenchError, match="repeat-share"):
        await run_bench(_options(server.address, "double", input_files=files, repeat_share=0.5))


@pytest.fixture
def writer():
    with serving_writer() as running:
        yield running


async def test_stream_mode_times_the_first_response_and_the_gaps(writer) -> None:
    servicer, address = writer
    options = _options(
        address, "writer", concurrency=(1, 3), stream=True, values={"PROMPT": "Hello", "COUNT": "5"}
    )
    report = await run_bench(options)

    for r in report.results:
        assert r.sent > 0 and r.sent == r.ok and not r.errors
        assert r.window_ok > 0 and r.stream_responses == 5 * r.window_ok
        assert r.first_response.size == r.window_ok and r.gaps.size == 4 * r.window_ok
        assert (r.first_response <= r.latencies.max()).all() and (r.gaps >= 0).all()
        assert r.responses_per_s == pytest.approx(5 * r.requests_per_s)
    # Every request asked for the empty final response, and every stream held open after it was cancelled.
    assert all(q.parameters["triton_enable_empty_final_response"].bool_param for q in servicer.requests)
    assert servicer.cancelled.is_set()
    text = format_report(report)
    assert "streams/s" in text and "first p50" in text and "gap p99" in text
    stream = report.to_dict()["results"][0]["stream"]
    assert stream["responses_per_stream"] == 5 and {"p50", "p99", "mean"} <= stream["gap_ms"].keys()


async def test_stream_mode_counts_a_failed_stream_once(writer) -> None:
    _, address = writer
    options = _options(address, "writer", stream=True, values={"PROMPT": "fail", "COUNT": "5"}, duration=1.5)
    (r,) = (await run_bench(options)).results
    assert r.sent > 0 and r.ok == 0 and dict(r.errors) == {"UNKNOWN": r.sent}


async def test_stream_mode_needs_grpc_and_values_of_the_inputs_datatype(writer) -> None:
    _, address = writer
    with pytest.raises(BenchError, match="--stream needs --protocol grpc"):
        await run_bench(_options(address, "writer", stream=True, protocol="http"))
    with pytest.raises(BenchError, match="--value COUNT: 'x' is not a value of datatype INT32"):
        await run_bench(_options(address, "writer", stream=True, values={"PROMPT": "a", "COUNT": "x"}))

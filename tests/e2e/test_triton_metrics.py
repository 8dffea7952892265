"""Triton's metric names on every server's /metrics: the router (each ensemble and each stage model as it
sees them) and each stage service (its own models), scraped from real processes after real requests.

The exposition is parsed with prometheus_client's parser for types, labels and values. That parser renames
a counter's samples to `<name>_total` (OpenMetrics' convention), so the exact sample names Triton uses
(no `_total`) are checked on the raw text as well.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from examples.digit_images import encode
from examples.models.digits import load_split
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.tools.client import InferenceClient, bytes_batch
from tests.e2e.conftest import Process, start_service, wait_serving

pytestmark = pytest.mark.e2e

COUNTERS = (
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
)
PENDING = "nv_inference_pending_request_count"
#: Models each server must report among its others (the router: every ensemble and every stage model).
MODELS = {
    "router": {"digits", "embeddings", "refcnn", "digits_preprocess", "digits_cnn", "digits_postprocess"},
    "preprocess": {"digits_preprocess", "embeddings_tokenize"},
    "model": {"digits_cnn"},
    "postprocess": {"digits_postprocess"},
}
STEPS = ("digits_preprocess", "digits_cnn", "digits_postprocess")


@dataclass
class Server:
    process: Process
    metrics_port: int

    def scrape(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return reply.read().decode()

    def statistics(self) -> dict[str, pb.ModelStatistics]:
        with grpc.insecure_channel(self.process.address) as channel:
            reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                pb.ModelStatisticsRequest(), timeout=10
            )
        return {s.name: s for s in reply.model_stats}


def _start(name: str, command: list[str], tmp: Path, env: dict[str, str] | None = None) -> Server:
    port_file = tmp / f"{name}.metrics-port"
    process = start_service(
        name, [*command, "--metrics-port", "0", "--metrics-port-file", str(port_file)], tmp, env
    )
    wait_serving(process)
    return Server(process, int(port_file.read_text()))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, model_dir) -> Iterator[dict[str, Server]]:
    """The digits pipeline as four processes, each serving its metrics on a port the OS picks."""
    tmp = tmp_path_factory.mktemp("triton-metrics")
    running: dict[str, Server] = {}
    try:
        running["preprocess"] = _start("preprocess", ["-m", "services.preprocess"], tmp)
        running["model"] = _start("model", ["-m", "services.model", "--model-dir", str(model_dir)], tmp)
        running["postprocess"] = _start("postprocess", ["-m", "services.postprocess"], tmp)
        addresses = {f"{n.upper()}_ADDRESS": s.process.address for n, s in running.items()}
        running["router"] = _start(
            "router", ["-m", "pipeline", "router", "--model-dir", str(model_dir)], tmp, addresses
        )
        yield running
    finally:
        for server in running.values():
            server.process.stop()


def _families(text: str) -> dict[str, tuple[str, dict[tuple[str, str], float]]]:
    """name -> (type, {(model, version): value}) for Triton's families; also checks their labels."""
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("nv_inference_"):
            values = {}
            for sample in family.samples:
                assert set(sample.labels) == {"model", "version"}, sample
                values[(sample.labels["model"], sample.labels["version"])] = sample.value
            found[family.name] = (family.type, values)
    return found


def _value(families, name: str, model: str) -> float:
    return families[name][1][(model, "1")]


def _delta(after, before, name: str, model: str) -> float:
    return _value(after, name, model) - _value(before, name, model)


def test_triton_metrics_of_every_server_count_the_requests_sent(servers):
    before = {name: _families(server.scrape()) for name, server in servers.items()}
    _, _, x_test, _ = load_split()
    requests, images = 3, 2
    with InferenceClient(servers["router"].process.address) as client:
        for i in range(requests):  # one after another: each request is one execution on every stage
            batch = [encode(x, scale=3) for x in x_test[i * images : (i + 1) * images]]
            client.infer("digits", {"IMAGE": bytes_batch(batch, (-1, 1))}, timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            client.infer("digits", {"IMAGE": bytes_batch([b"not an image"], (-1, 1))}, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    for name, server in servers.items():
        text = server.scrape()
        statistics = server.statistics()  # no request in between: the two views must agree exactly
        after = _families(text)
        for counter in COUNTERS:
            assert f"# TYPE {counter} counter\n" in text
            assert f"{counter}_total" not in text  # Triton's names carry no suffix
            assert after[counter][0] == "counter"
            assert {model for model, _ in after[counter][1]} == set(statistics), (name, counter)
        assert after[PENDING][0] == "gauge" and f"# TYPE {PENDING} gauge\n" in text
        assert {model for model, _ in after[PENDING][1]} == set(statistics)
        assert MODELS[name] <= set(statistics), name

        for model in statistics:
            stats = statistics[model]
            expected = {
                "nv_inference_request_success": stats.inference_stats.success.count,
                "nv_inference_request_failure": stats.inference_stats.fail.count,
                "nv_inference_count": stats.inference_count,
                "nv_inference_exec_count": stats.execution_count,
                "nv_inference_request_duration_us": stats.inference_stats.success.ns // 1000,
                "nv_inference_queue_duration_us": stats.inference_stats.queue.ns // 1000,
                "nv_inference_compute_input_duration_us": stats.inference_stats.compute_input.ns // 1000,
                "nv_inference_compute_infer_duration_us": stats.inference_stats.compute_infer.ns // 1000,
                "nv_inference_compute_output_duration_us": stats.inference_stats.compute_output.ns // 1000,
            }
            assert stats.version == "1"
            for counter, value in expected.items():
                assert _value(after, counter, model) == value, (name, model, counter)
            assert f'nv_inference_count{{model="{model}",version="1"}} {stats.inference_count}\n' in text
            assert _value(after, PENDING, model) == 0  # nothing waits once every answer is in

        # What the requests did, per model, on this server.
        def delta(counter: str, model: str) -> float:
            return _delta(after, before[name], counter, model)  # noqa: B023 - used within the iteration

        for model in MODELS[name] & {"digits", *STEPS}:
            assert delta("nv_inference_request_success", model) == requests, (name, model)
            assert delta("nv_inference_count", model) == requests * images, (name, model)
            # The router called the preprocess stage with the bad image too: one more execution there.
            refused_call = name == "router" and model == "digits_preprocess"
            assert delta("nv_inference_exec_count", model) == requests + refused_call, (name, model)
            assert delta("nv_inference_request_duration_us", model) > 0, (name, model)
            assert delta("nv_inference_compute_infer_duration_us", model) > 0, (name, model)
        # The undecodable image failed in the ensemble and in its first step, on the router and the stage.
        for model in MODELS[name] & {"digits", "digits_preprocess"}:
            assert delta("nv_inference_request_failure", model) == 1, (name, model)
        for model in MODELS[name] & {"digits_cnn", "digits_postprocess"}:
            assert delta("nv_inference_request_failure", model) == 0, (name, model)
        if name != "router":  # a stage times its own decode and encode
            (model,) = MODELS[name] & set(STEPS)
            assert delta("nv_inference_compute_input_duration_us", model) > 0
            assert delta("nv_inference_compute_output_duration_us", model) > 0


def test_every_server_exports_the_process_collector(servers):
    for name, server in servers.items():
        families = {f.name: f for f in text_string_to_metric_families(server.scrape())}
        assert families["process_cpu_seconds"].type == "counter", name
        assert families["process_cpu_seconds"].samples[0].value > 0, name
        assert families["process_resident_memory_bytes"].samples[0].value > 0, name
        assert families["process_open_fds"].type == "gauge", name
        # Ours stay beside Triton's.
        assert families["pipeline_requests"].type == "counter", name

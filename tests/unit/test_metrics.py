"""Triton's families as text: exact names, labels escaped, nanoseconds floored to microseconds."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.runtime.metrics import TRITON_COUNTERS, Metrics, _triton_text


def test_odd_model_names_are_escaped_and_durations_are_microseconds():
    name = 'a "quoted" back\\slash\nmodel'
    stats = pb.ModelStatistics(name=name, version="2", inference_count=5, execution_count=2)
    stats.inference_stats.success.count = 3
    stats.inference_stats.success.ns = 2_999_999  # 2,999.999 µs: Triton's integer microseconds floor it
    text = _triton_text([stats], {name: 4}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {n for n, _, _ in TRITON_COUNTERS} | {"nv_inference_pending_request_count"}
    (sample,) = families["nv_inference_request_duration_us"].samples
    assert sample.labels == {"model": name, "version": "2"} and sample.value == 2999
    assert families["nv_inference_count"].samples[0].value == 5
    assert families["nv_inference_pending_request_count"].samples[0].value == 4
    assert "nv_inference_count{" in text and "_total" not in text


def test_a_server_not_serving_yet_exports_triton_families_without_samples():
    async def statistics(name: str, version: str) -> pb.ModelStatisticsResponse:
        raise AssertionError("read without an event loop to read it on")

    metrics = Metrics()
    metrics.export_statistics(statistics)  # `serve()` has not run: no event loop to read it on yet
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    assert families["nv_inference_request_success"].samples == []
    assert families["process_cpu_seconds"].samples[0].value > 0

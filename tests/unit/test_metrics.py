"""Triton's families as text: exact names, labels escaped, nanoseconds floored to microseconds."""

from __future__ import annotations

import pytest
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


def test_counters_and_histograms_read_as_prometheus_client_writes_them():
    metrics = Metrics()
    metrics.requests.labels("refcnn", "OK").inc()
    metrics.requests.labels("refcnn", "OK").inc(2)
    metrics.requests.labels("refcnn", "INVALID_ARGUMENT").inc()
    for seconds in (0.0005, 0.0007, 0.003, 20.0):  # on a bound, between bounds, past the last
        metrics.request_duration.labels("refcnn").observe(seconds)
    metrics.cache_evictions.inc()
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    counts = {s.labels["outcome"]: s.value for s in families["pipeline_requests"].samples}
    assert counts == {"OK": 3, "INVALID_ARGUMENT": 1}
    samples = families["pipeline_request_duration_seconds"].samples
    buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
    assert (buckets["0.0005"], buckets["0.001"], buckets["0.005"], buckets["10.0"]) == (1, 2, 3, 3)
    assert buckets["+Inf"] == 4
    total = next(s.value for s in samples if s.name.endswith("_sum"))
    assert abs(total - 20.0042) < 1e-9
    assert families["pipeline_cache_evictions"].samples[0].value == 1


def test_a_child_with_the_wrong_labels_is_refused():
    with pytest.raises(ValueError, match="pipeline_requests"):
        Metrics().requests.labels("refcnn")

"""Triton's custom metrics API (`pb_utils.MetricFamily`, `Metric`) as its examples use it, what it refuses
with Triton's words, how long families and series last, and how they are written on `/metrics` (Triton
2.51's text, recorded by hand from its server) and added up across a stage's replicas."""

from __future__ import annotations

import gc
import math

import pytest

from pipeline.runtime.model_metrics import MODEL_FAMILIES, exposition, merge, number
from pipeline.stage import triton_python_backend_utils as pb_utils


def _family(name: str) -> dict | None:
    return next((f for f in MODEL_FAMILIES.snapshot() if f["name"] == name), None)


def test_a_counter_as_the_custom_metrics_example_uses_it() -> None:
    family = pb_utils.MetricFamily(
        name="unit_latency_ns",
        description="Cumulative time spent processing requests",
        kind=pb_utils.MetricFamily.COUNTER,
    )
    metric = family.Metric(labels={"version": "1", "model": "custom_metrics"})
    metric.increment(1500)
    metric.increment(0.5)
    assert metric.value() == 1500.5
    # Another instance of the model makes the same family and labels: one series, one value.
    twin = pb_utils.MetricFamily(
        name="unit_latency_ns", description="another text", kind=pb_utils.MetricFamily.COUNTER
    )
    twin.Metric(labels={"model": "custom_metrics", "version": "1"}).increment(2)
    assert metric.value() == 1502.5
    assert exposition([_family("unit_latency_ns")]) == (
        "# HELP unit_latency_ns Cumulative time spent processing requests\n"
        "# TYPE unit_latency_ns counter\n"
        'unit_latency_ns{model="custom_metrics",version="1"} 1502.5\n'
    )


def test_gauges_and_histograms() -> None:
    gauges = pb_utils.MetricFamily("unit_gauge", "A gauge", pb_utils.MetricFamily.GAUGE)
    gauge = gauges.Metric(labels={"a": 'x"y\\z\nw'})
    gauge.set(7)
    gauge.increment(-2)
    unlabelled = gauges.Metric()
    unlabelled.set(100000)
    assert gauge.value() == 5
    histograms = pb_utils.MetricFamily("unit_hist", "A histogram", pb_utils.MetricKind.HISTOGRAM)
    histogram = histograms.Metric(labels={"k": "v"}, buckets=[1.0, 2.5, 10])
    for value in (0.5, 1.0, 2.0, 11, 2.5):
        histogram.observe(value)
    empty = histograms.Metric(labels={"b": "4"}, buckets=[])
    # What Triton 2.51 wrote for the same calls.
    assert exposition([_family("unit_gauge"), _family("unit_hist")]) == (
        "# HELP unit_gauge A gauge\n"
        "# TYPE unit_gauge gauge\n"
        'unit_gauge{a="x\\"y\\\\z\\nw"} 5\n'
        "unit_gauge 100000\n"
        "# HELP unit_hist A histogram\n"
        "# TYPE unit_hist histogram\n"
        'unit_hist_count{k="v"} 5\n'
        'unit_hist_sum{k="v"} 17\n'
        'unit_hist_bucket{k="v",le="1"} 2\n'
        'unit_hist_bucket{k="v",le="2.5"} 4\n'
        'unit_hist_bucket{k="v",le="10"} 4\n'
        'unit_hist_bucket{k="v",le="+Inf"} 5\n'
        'unit_hist_count{b="4"} 0\n'
        'unit_hist_sum{b="4"} 0\n'
        'unit_hist_bucket{b="4",le="+Inf"} 0\n'
    )
    assert (gauge, unlabelled, empty) is not None  # kept alive until here


@pytest.mark.parametrize(
    ("kind", "operation", "value", "message"),
    [
        (
            "COUNTER",
            "increment",
            -1,
            "Failed to increment metric value: a COUNTER can only be incremented by non-negative",
        ),
        ("COUNTER", "set", 5, "Failed to set metric value: a COUNTER does not support set"),
        ("COUNTER", "observe", 5, "Failed to observe metric value: a COUNTER does not support observe"),
        ("GAUGE", "observe", 1, "Failed to observe metric value: a GAUGE does not support observe"),
        (
            "HISTOGRAM",
            "increment",
            1,
            "Failed to increment metric value: a HISTOGRAM does not support increment",
        ),
        ("HISTOGRAM", "set", 1, "Failed to set metric value: a HISTOGRAM does not support set"),
        ("HISTOGRAM", "value", None, "Failed to get metric value: a HISTOGRAM does not support value"),
    ],
)
def test_what_a_kind_does_not_support_is_refused(
    kind: str, operation: str, value: float | None, message: str
) -> None:
    family = pb_utils.MetricFamily(
        f"unit_refused_{kind.lower()}", "refusals", getattr(pb_utils.MetricFamily, kind)
    )
    metric = family.Metric(buckets=[1.0] if kind == "HISTOGRAM" else None)
    with pytest.raises(pb_utils.TritonModelException, match=message):
        getattr(metric, operation)(*([] if value is None else [value]))


def test_what_triton_refuses_when_a_metric_is_made() -> None:
    counters = pb_utils.MetricFamily("unit_made", "made", pb_utils.MetricFamily.COUNTER)
    histograms = pb_utils.MetricFamily("unit_made_hist", "made", pb_utils.MetricFamily.HISTOGRAM)
    for make, message in (
        (lambda: counters.Metric(labels=[("a", "b")]), "Labels must be a dictionary"),
        (lambda: counters.Metric(labels={"a": 1}), "label 'a' has the value 1, a int: not a string"),
        (lambda: counters.Metric(labels={"bad-name": "1"}), "invalid label name 'bad-name'"),
        (lambda: counters.Metric(buckets=[1.0]), "unexpected buckets found"),
        (lambda: histograms.Metric(), "missing required buckets"),
        (lambda: histograms.Metric(buckets="1,2"), "Buckets must be a list"),
        (lambda: histograms.Metric(buckets=[2.0, 1.0]), "bucket boundaries must be strictly sorted"),
        (
            lambda: pb_utils.MetricFamily("unit_made", "made", pb_utils.MetricFamily.GAUGE),
            "exists as a counter",
        ),
        (lambda: pb_utils.MetricFamily("bad-name", "x", pb_utils.MetricFamily.GAUGE), "invalid metric name"),
        (
            lambda: pb_utils.MetricFamily("unit_kind", "x", 7),
            "kind 7 is not MetricFamily.COUNTER, GAUGE or HISTOGRAM",
        ),
    ):
        with pytest.raises(pb_utils.TritonModelException, match=message):
            make()
    with pytest.raises(TypeError, match="increment"):
        counters.Metric().increment("x")  # type: ignore[arg-type]


def test_families_and_series_last_as_long_as_their_objects() -> None:
    family = pb_utils.MetricFamily("unit_lifetime", "lifetime", pb_utils.MetricFamily.GAUGE)
    kept = family.Metric(labels={"kept": "yes"})
    family.Metric(labels={"kept": "no"}).set(1)  # dropped at once: its series goes with it
    gc.collect()
    assert [s["labels"] for s in _family("unit_lifetime")["series"]] == [{"kept": "yes"}]
    del family  # the metric keeps its family
    gc.collect()
    assert _family("unit_lifetime") is not None
    del kept
    gc.collect()
    assert _family("unit_lifetime") is None


def test_the_router_adds_up_the_series_of_a_stages_replicas() -> None:
    def replica(value: float, counts: list[int], kind: str = "counter") -> list[dict]:
        return [
            {
                "name": "c",
                "description": "C",
                "kind": kind,
                "series": [{"labels": {"m": "a"}, "value": value}],
            },
            {
                "name": "h",
                "description": "H",
                "kind": "histogram",
                "series": [{"labels": {}, "buckets": [1.0], "counts": counts, "sum": float(sum(counts))}],
            },
        ]

    one, two = replica(2, [1, 0]), replica(3.5, [2, 1])
    two[0]["series"].append({"labels": {"m": "b"}, "value": 1})
    merged = merge([*one, *two, *replica(100, [5, 5], kind="gauge")[:1]])  # a gauge called "c" is left out
    assert exposition(merged) == (
        "# HELP c C\n# TYPE c counter\n"
        'c{m="a"} 5.5\n'
        'c{m="b"} 1\n'
        "# HELP h H\n# TYPE h histogram\n"
        "h_count 4\nh_sum 4\n"
        'h_bucket{le="1"} 3\n'
        'h_bucket{le="+Inf"} 4\n'
    )
    assert one[0]["series"][0]["value"] == 2  # what was merged is left as it was


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (5.5, "5.5"),
        (17.0, "17"),
        (100000.0, "100000"),  # Triton 2.51 wrote this one (tests/parity: metrics_custom)
        (123456789012.0, "123456789012"),
        (1e16, "1e+16"),
        (0.1 + 0.2, "0.3"),
        (0.797979797979798, "0.797979797979798"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (-3.0, "-3"),
        (0.0, "0"),
        (math.nan, "Nan"),
        (math.inf, "+Inf"),
        (-math.inf, "-Inf"),
    ],
)
def test_numbers_are_written_as_prometheus_cpp_writes_them(value: float, text: str) -> None:
    assert number(value) == text

"""Prometheus metrics of one server (router or stage service), served over HTTP by `prometheus_client`.

Every server has its own `CollectorRegistry`, so several servers can run in one process (the tests do).
Counters and histograms are updated on the request path; gauges (queue depth, batches in flight, stage
health) are read from their owners only when Prometheus scrapes, so they cost nothing in between.

| metric | labels | what |
|---|---|---|
| `pipeline_requests_total` | model, outcome | inference requests answered, by gRPC status code name |
| `pipeline_request_duration_seconds` | model | time from a request's arrival to its answer |
| `pipeline_queue_duration_seconds` | model | time a request waited for its batch (router) or model thread (stage) |
| `pipeline_compute_duration_seconds` | model | time of one execution: a stage call (router), `infer` (stage) |
| `pipeline_batch_size` | model | items per execution |
| `pipeline_stage_calls_total` | stage, outcome | the router's calls of each stage, by gRPC status code name |
| `pipeline_queue_depth` | model | requests waiting now |
| `pipeline_inflight_batches` | model | executions running now |
| `pipeline_stage_healthy` | stage | 1 when the stage's health check says SERVING (router) |
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

#: Latency buckets from half a millisecond: stage calls on a CPU take a few.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

#: A gauge source: returns (label value, value) pairs when scraped.
GaugeSource = Callable[[], Iterable[tuple[str, float]]]


@dataclass(frozen=True, slots=True)
class _Gauge:
    name: str
    documentation: str
    label: str
    source: GaugeSource


class _Gauges(Collector):
    """Gauges computed at scrape time from the objects that own the state."""

    def __init__(self) -> None:
        self.gauges: list[_Gauge] = []

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families: dict[str, GaugeMetricFamily] = {}
        for gauge in self.gauges:
            family = families.get(gauge.name)
            if family is None:
                family = families[gauge.name] = GaugeMetricFamily(
                    gauge.name, gauge.documentation, labels=[gauge.label]
                )
            for label, value in gauge.source():
                family.add_metric([label], value)
        return list(families.values())

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []


class Metrics:
    """The metrics of one server, in a registry of its own; `serve()` exposes them over HTTP."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pipeline_requests",
            "Inference requests answered, by model and gRPC outcome",
            ["model", "outcome"],
            registry=r,
        )
        self.request_duration = Histogram(
            "pipeline_request_duration_seconds",
            "Time from a request's arrival to its answer",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_duration = Histogram(
            "pipeline_queue_duration_seconds",
            "Time a request waited before its execution started",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_duration = Histogram(
            "pipeline_compute_duration_seconds",
            "Time of one execution (a stage call on the router, the model's infer on a stage)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "pipeline_batch_size", "Items per execution", ["model"], buckets=BATCH_BUCKETS, registry=r
        )
        self.stage_calls = Counter(
            "pipeline_stage_calls",
            "The router's calls of each stage, by gRPC outcome",
            ["stage", "outcome"],
            registry=r,
        )
        self._gauges = _Gauges()
        r.register(self._gauges)
        self._server: WSGIServer | None = None
        self.port: int | None = None

    def gauge(self, name: str, documentation: str, label: str, source: GaugeSource) -> None:
        """Add a gauge read from `source` at scrape time (several sources may share a name)."""
        self._gauges.gauges.append(_Gauge(name, documentation, label, source))

    def serve(self, host: str, port: int | None) -> int | None:
        """Serve `/metrics` on a thread; returns the bound port, or None when off or the port is taken.

        A port that cannot be bound is logged, not fatal: metrics must not keep a server from serving.
        """
        if port is None or port < 0:
            return None
        try:
            server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            log.error("cannot serve metrics on %s:%d: %s; serving without them", host, port, err)
            return None
        self._server = server
        self.port = server.server_port
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        """Stop the HTTP server, if one runs."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def metrics_port(text: str) -> int | None:
    """An argparse type for `--metrics-port`: a port, 0 for one the OS picks, `off` or negative for none."""
    if text.strip().lower() in ("off", "none", ""):
        return None
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number or 'off', got {text!r}") from None
    return None if port < 0 else port

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
| `nv_inference_first_response_histogram_ms` | model | time from a streamed request's arrival to its first response, in milliseconds (Triton's name) |
| `pipeline_stage_calls_total` | stage, outcome | the router's calls of each stage, by gRPC status code name |
| `pipeline_stage_retries_total` | stage | calls the router sent again (to another replica, within the retry budget) |
| `pipeline_queue_depth` | model | requests waiting now |
| `pipeline_inflight_batches` | model | executions running now |
| `pipeline_stage_inflight_calls` | stage, replica | the router's calls in flight to each replica now |
| `pipeline_stage_replicas_ready` | stage | replicas whose health says SERVING (router) |
| `pipeline_stage_model_replicas_ready` | stage, model | of those, the replicas whose `RepositoryIndex` lists the model as READY: the replicas its calls go to (router) |
| `pipeline_stage_healthy` | stage | 1 when the stage's health check says SERVING (router) |
| `pipeline_branch_requests_total` | ensemble, step, taken | requests that ran (`true`) or skipped (`false`) each step of an ensemble with conditions (router) |
| `pipeline_cache_requests_total` | model, result | lookups in the response cache: `hit` or `miss` (router) |
| `pipeline_repository_changes_total` | model, action, outcome | `load`/`unload` through the router across a stage's replicas (`ok`, `rolled_back`, `not_found`) and replicas brought in line with the fleet (`reconcile`: `ok`, `failed`) (router) |
| `pipeline_cache_evictions_total` | | entries the response cache dropped to stay within its size (router) |
| `pipeline_cache_bytes`, `pipeline_cache_entries` | cache | what the response cache holds now (router) |
| `pipeline_cache_waiting` | cache | requests waiting now for an identical request's response (router) |

Beside them, Triton's per-model metrics with Triton's names, types, help texts and labels (`model`,
`version`), so dashboards and autoscalers written for Triton read ours as they are: `nv_inference_request_success`,
`nv_inference_request_failure`, `nv_inference_count`, `nv_inference_exec_count`, the cumulative microsecond
counters `nv_inference_request_duration_us`, `nv_inference_queue_duration_us` and
`nv_inference_compute_{input,infer,output}_duration_us`, and the gauge `nv_inference_pending_request_count`.
They are read at scrape time from the server's own `ModelStatistics` (`pipeline.runtime.model_statistics`),
so the two views always agree.

These families are written by `_triton_text`, after the registry's, and served by this module's own HTTP
server, because prometheus-client (0.26) can do neither as Triton does:

- its text exposition (`generate_latest`) names every family of type `counter` `<name>_total` in its
  `# HELP` and `# TYPE` lines, whatever the family's name and its samples' (a collector's
  `Metric(name, doc, "counter")` with samples named `nv_inference_count` comes out as
  `# TYPE nv_inference_count_total counter` above `nv_inference_count{...} 5.0`), and it writes every value
  as a float (`5.0`, `0.0`) where Triton writes the integer its counters and pending count hold (`5`);
- its server (`start_http_server`, `make_wsgi_app`) answers every path with the registry's exposition
  alone, in the format the scraper's `Accept` header picks (Prometheus asks for OpenMetrics first): there
  is no place for Triton's families in it, nor a way to keep to the text format Triton always answers in.

So `/metrics` (and `/`; other paths are 404) always answers in the Prometheus text format (version 0.0.4),
as Triton's does, whatever the scraper asks for; the server listens on the address family its host
resolves to (IPv6 too), on the port the OS picks for port 0. The registry also holds Prometheus' standard
process collector (`process_cpu_seconds_total`, memory, open files, ...).

The counters and histograms updated per request are this module's own (`LoopCounter`, `LoopHistogram`):
plain numbers that the server's event loop adds to without a lock, exposed through the registry as
prometheus-client's metric families at scrape time. prometheus-client's own instruments take a lock and
walk their buckets in Python on every observation: with thirteen of them per stage call, a stage spent a
seventh of its CPU on them.
"""

from __future__ import annotations

import abc
import asyncio
import bisect
import logging
import socket
import threading
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.runtime.model_metrics import Snapshot, exposition

log = logging.getLogger(__name__)

#: Latency buckets from half a millisecond: stage calls on a CPU take a few.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Triton's buckets of the time to a streamed request's first response, in milliseconds.
FIRST_RESPONSE_BUCKETS = (100, 500, 2000, 5000)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

#: A gauge source: returns (label value, value) pairs when scraped; the label value is a tuple where the
#: gauge has several labels.
GaugeSource = Callable[[], Iterable[tuple[str | tuple[str, ...], float]]]
#: A server's `ModelStatistics` (its data plane's `statistics(name, version)`), every model when name is "".
StatisticsSource = Callable[[str, str], Coroutine[Any, Any, pb.ModelStatisticsResponse]]
#: A server's model metric families (`pipeline.runtime.model_metrics`): its process's, or its stages'.
FamiliesSource = Callable[[], Coroutine[Any, Any, list[Snapshot]]]

#: The gauge whose sources say how many requests of each model wait now (Triton's pending request count).
QUEUE_DEPTH = "pipeline_queue_depth"
#: The Prometheus text format, as Triton serves it: counters need no `_total` suffix there.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: How long a scrape waits for the event loop to read the statistics.
STATISTICS_TIMEOUT_S = 5.0

#: Triton's per-model counters: name, help text (Triton's own), and the value read from one model's
#: `ModelStatistics`. Durations are cumulative microseconds, from the nanoseconds the statistics keep.
TRITON_COUNTERS: tuple[tuple[str, str, Callable[[pb.ModelStatistics], int]], ...] = (
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        lambda s: s.inference_stats.success.count,
    ),
    (
        "nv_inference_request_failure",
        "Number of failed inference requests, all batch sizes",
        lambda s: s.inference_stats.fail.count,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        lambda s: s.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed (does not include cached requests)",
        lambda s: s.execution_count,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds (includes cached requests)",
        lambda s: s.inference_stats.success.ns // 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
        lambda s: s.inference_stats.queue.ns // 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
        lambda s: s.inference_stats.compute_input.ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
        lambda s: s.inference_stats.compute_infer.ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
        lambda s: s.inference_stats.compute_output.ns // 1000,
    ),
)
TRITON_PENDING = (
    "nv_inference_pending_request_count",
    "Instantaneous number of pending requests awaiting execution per-model.",
)


class CounterChild:
    """One labelled counter's value."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    """One labelled histogram's bucket counts (not cumulative; the last is +Inf's) and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # A bucket's bound is inclusive (`le`): the first bound not below the value.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


Child = TypeVar("Child", "CounterChild", "HistogramChild")
T = TypeVar("T")


class _Family(abc.ABC, Generic[Child]):
    """A metric family whose children are made on first use and kept: `labels(...)` is one dict lookup.
    Updated on the server's event loop only (every request path runs there); read when scraped."""

    def __init__(self, name: str, documentation: str, labels: Iterable[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.label_names = tuple(labels)
        self.children: dict[tuple[str, ...], Child] = {}

    @abc.abstractmethod
    def _child(self) -> Child:
        """A new child, counting from zero."""

    def labels(self, *values: str) -> Child:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.label_names):
                raise ValueError(f"{self.name}: labels {self.label_names}, got {values!r}")
            child = self.children[values] = self._child()
        return child

    @abc.abstractmethod
    def family(self) -> Metric:
        """prometheus-client's family of these children, as they are now."""


class LoopCounter(_Family[CounterChild]):
    """A counter (exposed as `NAME_total`)."""

    def _child(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        """Count on the family's one child, where it has no labels."""
        self.labels().inc(amount)

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=list(self.label_names))
        for values, child in list(self.children.items()):
            family.add_metric(list(values), child.value)
        return family


class LoopHistogram(_Family[HistogramChild]):
    """A histogram with fixed bucket bounds."""

    def __init__(
        self, name: str, documentation: str, labels: Iterable[str], buckets: Iterable[float]
    ) -> None:
        super().__init__(name, documentation, labels)
        self.bounds = tuple(float(b) for b in buckets)

    def _child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.label_names))
        for values, child in list(self.children.items()):
            counts, total = list(child.counts), child.sum
            cumulative, buckets = 0, []
            for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric(list(values), buckets, sum_value=total)
        return family


class _Families(Collector):
    """The server's counters and histograms, as metric families when scraped."""

    def __init__(self) -> None:
        self.families: list[_Family[Any]] = []

    def counter(self, name: str, documentation: str, *labels: str) -> LoopCounter:
        family = LoopCounter(name, documentation, labels)
        self.families.append(family)
        return family

    def histogram(self, name: str, documentation: str, buckets: Iterable[float]) -> LoopHistogram:
        """A histogram labelled by model."""
        family = LoopHistogram(name, documentation, ("model",), buckets)
        self.families.append(family)
        return family

    def collect(self) -> Iterable[Metric]:
        return [family.family() for family in self.families]

    def describe(self) -> Iterable[Metric]:
        return []


@dataclass(frozen=True, slots=True)
class _Gauge:
    name: str
    documentation: str
    labels: tuple[str, ...]
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
                    gauge.name, gauge.documentation, labels=list(gauge.labels)
                )
            for label, value in gauge.source():
                family.add_metric([label] if isinstance(label, str) else list(label), value)
        return list(families.values())

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []


class Metrics:
    """The metrics of one server, in a registry of its own; `serve()` exposes them over HTTP."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        families = _Families()
        r.register(families)
        counter, histogram = families.counter, families.histogram
        self.requests = counter(
            "pipeline_requests", "Inference requests answered, by model and gRPC outcome", "model", "outcome"
        )
        self.request_duration = histogram(
            "pipeline_request_duration_seconds",
            "Time from a request's arrival to its answer",
            LATENCY_BUCKETS,
        )
        self.queue_duration = histogram(
            "pipeline_queue_duration_seconds",
            "Time a request waited before its execution started",
            LATENCY_BUCKETS,
        )
        self.compute_duration = histogram(
            "pipeline_compute_duration_seconds",
            "Time of one execution (a stage call on the router, the model's infer on a stage)",
            LATENCY_BUCKETS,
        )
        self.first_response = histogram(
            "nv_inference_first_response_histogram_ms",
            "Duration from request to first response in milliseconds",
            FIRST_RESPONSE_BUCKETS,
        )
        self.batch_size = histogram("pipeline_batch_size", "Items per execution", BATCH_BUCKETS)
        self._add_router_counters(counter)
        self._gauges = _Gauges()
        r.register(self._gauges)
        ProcessCollector(registry=r)
        self._statistics: StatisticsSource | None = None
        self._families: FamiliesSource | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: ThreadingHTTPServer | None = None
        self.port: int | None = None

    def _add_router_counters(self, counter: Callable[..., LoopCounter]) -> None:
        """The router's own counters: its stage calls and retries, ensemble branches, response cache and
        repository changes (a stage service leaves them at zero)."""
        self.stage_calls = counter(
            "pipeline_stage_calls", "The router's calls of each stage, by gRPC outcome", "stage", "outcome"
        )
        self.branch_requests = counter(
            "pipeline_branch_requests",
            "Requests that ran (taken=true) or skipped (taken=false) a step of an ensemble with conditions",
            "ensemble",
            "step",
            "taken",
        )
        self.cache_requests = counter(
            "pipeline_cache_requests",
            "Response cache lookups, by model and result (hit or miss)",
            "model",
            "result",
        )
        self.cache_evictions = counter(
            "pipeline_cache_evictions", "Entries the response cache dropped to stay within its size"
        )
        self.stage_retries = counter(
            "pipeline_stage_retries",
            "Stage calls the router sent again, within the stage's retry budget",
            "stage",
        )
        self.repository_changes = counter(
            "pipeline_repository_changes",
            "Loads and unloads through the router across a stage's replicas, and the replicas brought in line "
            "with what the fleet serves, by model, action and outcome",
            "model",
            "action",
            "outcome",
        )

    def gauge(self, name: str, documentation: str, label: str | tuple[str, ...], source: GaugeSource) -> None:
        """Add a gauge read from `source` at scrape time (several sources may share a name)."""
        labels = (label,) if isinstance(label, str) else label
        self._gauges.gauges.append(_Gauge(name, documentation, labels, source))

    def export_statistics(self, source: StatisticsSource) -> None:
        """Export Triton's `nv_inference_*` metrics of every model `source` (a data plane's statistics)
        reports; read on the event loop that calls `serve()`, where the statistics are kept."""
        self._statistics = source

    def export_families(self, source: FamiliesSource) -> None:
        """Show the model metric families `source` gives (Triton's custom metrics) after Triton's own; read
        on the event loop that calls `serve()`."""
        self._families = source

    def exposition(self) -> bytes:
        """The `/metrics` page: the registry's metrics, then Triton's, then the models' families (Prometheus
        text format 0.0.4)."""
        statistics, families = self._statistics, self._families
        stats = (
            None if statistics is None else self._on_loop(lambda: statistics("", ""), "the model statistics")
        )
        custom = None if families is None else self._on_loop(families, "the models' metric families")
        return (
            generate_latest(self.registry)
            + _triton_text([] if stats is None else stats.model_stats, self._pending())
            + exposition(custom or []).encode()
        )

    def _on_loop(self, source: Callable[[], Coroutine[Any, Any, T]], what: str) -> T | None:
        """What `source` gives, run on the server's event loop; None where it cannot run or it failed."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return None
        # NOTE: scrapes run on the HTTP server's thread; the statistics and families belong to the loop's.
        future = asyncio.run_coroutine_threadsafe(source(), loop)
        try:
            return future.result(STATISTICS_TIMEOUT_S)
        except Exception as err:  # a scrape must not fail for it: the other metrics still come
            future.cancel()
            log.warning("metrics: cannot read %s: %r", what, err)
            return None

    def _pending(self) -> dict[str, float]:
        pending: dict[str, float] = {}
        for gauge in self._gauges.gauges:
            if gauge.name == QUEUE_DEPTH:
                for model, value in gauge.source():
                    key = model if isinstance(model, str) else model[0]
                    pending[key] = pending.get(key, 0) + value
        return pending

    def serve(self, host: str, port: int | None) -> int | None:
        """Serve `/metrics` on a thread; returns the bound port, or None when off or the port is taken.

        Called on the server's event loop (Triton's metrics are read there). A port that cannot be bound is
        logged, not fatal: metrics must not keep a server from serving.
        """
        if port is None or port < 0:
            return None
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            server_class = type("MetricsServer", (ThreadingHTTPServer,), {"address_family": family})
            server = server_class((host, port), _handler(self))
        except OSError as err:
            log.error("cannot serve metrics on %s:%d: %s; serving without them", host, port, err)
            return None
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
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


def _handler(metrics: Metrics) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        """GET /metrics (or /): the exposition; anything else: 404."""

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            body = metrics.exposition()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a scrape every few seconds is not news

    return MetricsHandler


def _label(value: str) -> str:
    """A label value escaped for the text format."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _triton_text(stats: Iterable[pb.ModelStatistics], pending: dict[str, float]) -> bytes:
    """Triton's families in the Prometheus text format, one sample per model and version."""
    stats = list(stats)
    lines = []
    for name, documentation, value in TRITON_COUNTERS:
        lines += [f"# HELP {name} {documentation}", f"# TYPE {name} counter"]
        lines += [
            f'{name}{{model="{_label(s.name)}",version="{_label(s.version)}"}} {value(s)}' for s in stats
        ]
    name, documentation = TRITON_PENDING
    lines += [f"# HELP {name} {documentation}", f"# TYPE {name} gauge"]
    lines += [
        f'{name}{{model="{_label(s.name)}",version="{_label(s.version)}"}} {pending.get(s.name, 0):g}'
        for s in stats
    ]
    return ("\n".join(lines) + "\n").encode()

"""What a run measured, and its three forms: the tables `pipeline bench` prints, JSON and a PNG plot."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.tools.bench.options import BenchError, BenchOptions, Level


@dataclass
class LevelResult:
    """What one level measured. Counts cover the whole level (warm-up included) unless `window_` says so."""

    level: Level
    duration: float
    batch: int
    sent: int = 0
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    window_ok: int = 0
    window_errors: Counter[str] = field(default_factory=Counter)
    #: Latencies in seconds of the successful responses that arrived in the measured interval.
    latencies: np.ndarray = field(default_factory=lambda: np.empty(0))
    #: Open loop: arrivals not sent because `max_inflight` requests were already outstanding.
    dropped: int = 0
    #: Per-model deltas of the server's statistics over the measured interval; None when not served.
    stages: dict[str, dict[str, Any]] | None = None
    #: Why `stages` is None although the server lists `statistics` (the RPC failed).
    stages_error: str | None = None
    #: CPU seconds each `cpu_metrics` process used over the measured interval (None: it could not be read).
    cpu_seconds: dict[str, float | None] = field(default_factory=dict)
    #: Whether requests were streamed (`--stream`); then the figures below are kept for the streams whose
    #: last response arrived in the measured interval.
    streamed: bool = False
    #: Their responses that carried outputs, in all.
    stream_responses: int = 0
    #: Seconds from each one's request to its first response.
    first_response: np.ndarray = field(default_factory=lambda: np.empty(0))
    #: Seconds between one response and the next of the same stream.
    gaps: np.ndarray = field(default_factory=lambda: np.empty(0))

    def cpu_us_per_request(self) -> dict[str, float | None]:
        """CPU microseconds per successful request in the measured interval, by process, and in all."""
        if not self.cpu_seconds or not self.window_ok:
            return {}
        per = {
            name: None if cpu is None else cpu * 1e6 / self.window_ok
            for name, cpu in self.cpu_seconds.items()
        }
        known = [v for v in per.values() if v is not None]
        per["all"] = sum(known) if len(known) == len(per) else None
        return per

    @property
    def responses(self) -> int:
        """Every response counted, successful or not."""
        return self.ok + sum(self.errors.values())

    @property
    def requests_per_s(self) -> float:
        return self.window_ok / self.duration

    @property
    def infer_per_s(self) -> float:
        return self.window_ok * self.batch / self.duration

    def percentile_ms(self, q: float) -> float:
        return _percentile_ms(self.latencies, q)

    def outside_server_us(self, model: str) -> tuple[float, float] | None:
        """The client's mean latency and what of it the server's statistics do not cover (its own mean
        request time subtracted: the client, the transport, and the server's RPC handling before and after
        the request), in microseconds; None where the server reported no time for `model`."""
        stats = (self.stages or {}).get(model)
        served = None if stats is None else stats["request_us"]
        if served is None or not self.latencies.size:
            return None
        client = float(self.latencies.mean() * 1e6)
        return client, client - served

    @property
    def responses_per_s(self) -> float:
        """Streamed responses with outputs per second, over the measured interval."""
        return self.stream_responses / self.duration

    def stream_dict(self) -> dict[str, Any]:
        """The streaming figures' JSON form."""
        return {
            "responses": self.stream_responses,
            "responses_per_s": self.responses_per_s,
            "streams_per_s": self.requests_per_s,
            "responses_per_stream": self.stream_responses / self.window_ok if self.window_ok else math.nan,
            "first_response_ms": _summary_ms(self.first_response),
            "gap_ms": _summary_ms(self.gaps),
        }

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        lat = self.latencies
        return {
            self.level.kind: int(self.level.value) if self.level.kind == "concurrency" else self.level.value,
            "duration_s": self.duration,
            "batch": self.batch,
            "sent": self.sent,
            "responses": self.responses,
            "ok": self.ok,
            "errors": dict(self.errors),
            "window": {"ok": self.window_ok, "errors": dict(self.window_errors)},
            "dropped": self.dropped,
            "throughput_infer_per_s": self.infer_per_s,
            "throughput_requests_per_s": self.requests_per_s,
            "latency_ms": {
                "p50": self.percentile_ms(50),
                "p90": self.percentile_ms(90),
                "p99": self.percentile_ms(99),
                "mean": float(lat.mean() * 1e3) if lat.size else math.nan,
                "min": float(lat.min() * 1e3) if lat.size else math.nan,
                "max": float(lat.max() * 1e3) if lat.size else math.nan,
            },
            "stages": self.stages,
            "stages_error": self.stages_error,
            "cpu_us_per_request": self.cpu_us_per_request(),
            **({"stream": self.stream_dict()} if self.streamed else {}),
        }


def _percentile_ms(seconds: np.ndarray, q: float) -> float:
    return float(np.percentile(seconds, q) * 1e3) if seconds.size else math.nan


def _summary_ms(seconds: np.ndarray) -> dict[str, float]:
    return {
        "p50": _percentile_ms(seconds, 50),
        "p99": _percentile_ms(seconds, 99),
        "mean": float(seconds.mean() * 1e3) if seconds.size else math.nan,
    }


@dataclass
class BenchReport:
    """A whole run: the server, the inputs sent and a result per level."""

    options: BenchOptions
    server: dict[str, Any]
    inputs: list[dict[str, Any]]
    results: list[LevelResult]

    @property
    def statistics(self) -> bool:
        return bool(self.server.get("statistics"))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (what `--json` writes)."""
        o = self.options
        return {
            "tool": "pipeline bench",
            "url": o.url,
            "protocol": o.protocol,
            "model": o.model,
            "model_version": o.model_version,
            "mode": "rate" if o.rates else "concurrency",
            "arrival": o.arrival if o.rates else None,
            "batch": o.batch,
            "warmup_s": o.warmup,
            "duration_s": o.duration,
            "processes": o.processes,
            "repeat_share": o.repeat_share,
            "connections": o.connections,
            "stream": o.stream,
            "server": self.server,
            "inputs": self.inputs,
            "results": [r.to_dict() for r in self.results],
        }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def format_report(report: BenchReport) -> str:
    """The tables `pipeline bench` prints: one row per level, then each level's per-model figures."""
    o = report.options
    kind = "rate/s" if o.rates else "concurrency"
    lines = [
        f"{o.model} at {o.url} ({o.protocol}): batch {report.results[0].batch if report.results else o.batch}, "
        f"{o.warmup:g} s warm-up + {o.duration:g} s measured per level"
        + (f", {o.arrival} arrivals" if o.rates else "")
        + (f", {o.processes} processes" if o.processes > 1 else "")
        + (f", {o.repeat_share:.0%} repeated inputs" if o.repeat_share is not None else ""),
        "",
        f"{kind:>11} {'infer/s':>10} {'req/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
        f"{'sent':>8} {'ok':>8}  errors",
    ]
    for r in report.results:
        errors = ", ".join(f"{code} {n}" for code, n in sorted(r.errors.items())) or "-"
        if r.dropped:
            errors += f" (dropped {r.dropped}: --max-inflight reached)"
        lines.append(
            f"{r.level.value:>11g} {r.infer_per_s:>10,.1f} {r.requests_per_s:>10,.1f} "
            f"{_fmt(r.percentile_ms(50), 2):>8} {_fmt(r.percentile_ms(90), 2):>8} "
            f"{_fmt(r.percentile_ms(99), 2):>8} {r.sent:>8} {r.ok:>8}  {errors}"
        )
    if o.stream:
        lines += _stream_table(report)
    for r in report.results:
        per = r.cpu_us_per_request()
        if per:
            lines += [
                "",
                f"CPU per request over the measured interval, {r.level.label} (process_cpu_seconds_total):",
                "  " + ", ".join(f"{name} {_fmt(us, 0)} us" for name, us in per.items()),
            ]
    if report.statistics:
        lines += _statistics_table(report)
    else:
        lines += ["", "(the server does not list 'statistics' in its extensions: client-side figures only)"]
    return "\n".join(lines)


def _statistics_table(report: BenchReport) -> list[str]:
    """The server's figures per level and model over the measured interval (its `ModelStatistics`), and how
    much of the client's latency the model's request time leaves."""
    o = report.options
    lines: list[str] = []
    for r in report.results:
        lines += [
            "",
            f"server statistics over the measured interval, {r.level.label}:",
            f"  {'model':<28} {'requests':>9} {'execs':>8} {'batch':>6} {'request us':>10} {'queue us':>9} "
            f"{'compute us':>10} {'infer us':>9} {'cache hit':>9}",
        ]
        if r.stages_error:
            lines[-1] = f"  ({r.stages_error}: client-side figures only)"
        for name, s in (r.stages or {}).items():
            compute = [s.get(k) for k in ("compute_input_us", "compute_infer_us", "compute_output_us")]
            total = sum(v for v in compute if v is not None) if any(v is not None for v in compute) else None
            lines.append(
                f"  {name:<28} {s['inference_count']:>9} {s['execution_count']:>8} "
                f"{_fmt(s['mean_batch_size']):>6} {_fmt(s['request_us']):>10} {_fmt(s['queue_us']):>9} "
                f"{_fmt(total):>10} {_fmt(s['compute_infer_us']):>9} {_hit_share(s):>9}"
            )
        outside = r.outside_server_us(o.model)
        if outside is not None:
            client, beyond = outside
            lines.append(
                f"  {o.model}: the client's mean latency {_fmt(client, 0)} us, of which {_fmt(beyond, 0)} us outside "
                "the server's request time (the client, the transport, the server's RPC handling)"
            )
    return lines


def _stream_table(report: BenchReport) -> list[str]:
    """The streaming figures: streams and responses per second, time to first response and the gaps."""
    kind = "rate/s" if report.options.rates else "concurrency"
    lines = [
        "",
        "streams (each request over ModelStreamInfer; the columns above count streams, their latency to the "
        "last response):",
        f"{kind:>11} {'streams/s':>10} {'resp/s':>10} {'resp/strm':>9} {'first p50':>9} {'first p99':>9} "
        f"{'gap p50':>8} {'gap p99':>8}  (ms)",
    ]
    for r in report.results:
        per_stream = r.stream_responses / r.window_ok if r.window_ok else math.nan
        lines.append(
            f"{r.level.value:>11g} {r.requests_per_s:>10,.1f} {r.responses_per_s:>10,.1f} {_fmt(per_stream):>9} "
            f"{_fmt(_percentile_ms(r.first_response, 50), 2):>9} {_fmt(_percentile_ms(r.first_response, 99), 2):>9} "
            f"{_fmt(_percentile_ms(r.gaps, 50), 2):>8} {_fmt(_percentile_ms(r.gaps, 99), 2):>8}"
        )
    return lines


def _hit_share(stats: Mapping[str, Any]) -> str:
    lookups = stats.get("cache_hits", 0) + stats.get("cache_misses", 0)
    return f"{stats['cache_hits'] / lookups:.0%}" if lookups else "-"


def write_json(report: BenchReport, path: Path) -> None:
    """Write the report's JSON form (NaN as null, so any JSON reader takes it)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    path.write_text(json.dumps(clean(report.to_dict()), indent=2) + "\n")


def write_plot(report: BenchReport, path: Path) -> None:
    """Throughput and p99 latency against the load level, as a PNG. Needs matplotlib (extra `bench`)."""
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'pipeline-serving[bench]'") from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    x = [r.level.value for r in report.results]
    xlabel = "arrival rate (requests/s)" if report.options.rates else "concurrency"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    try:
        left.plot(x, [r.infer_per_s for r in report.results], marker="o")
        left.set(xlabel=xlabel, ylabel="throughput (infer/s)", title="throughput")
        right.plot(x, [r.percentile_ms(99) for r in report.results], marker="o", color="tab:red")
        right.set(xlabel=xlabel, ylabel="p99 latency (ms)", title="p99 latency")
        for axis in (left, right):
            axis.grid(True, alpha=0.3)
            axis.set_ylim(bottom=0)
            if not report.options.rates and len(x) > 1 and max(x) / min(x) >= 8:
                axis.set_xscale("log", base=2)
                axis.set_xticks(x, [f"{v:g}" for v in x])
        fig.suptitle(f"{report.options.model} at {report.options.url} (batch {report.options.batch})")
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)

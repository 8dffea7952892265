"""The server's side of a level: Triton's `ModelStatistics` and each process's CPU, read around the measured
interval and turned into per-model figures."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.tools.bench.endpoints import GrpcEndpoint, HttpEndpoint

#: The `ServerMetadata.extensions` entry that says `ModelStatistics` is served.
STATISTICS_EXTENSION = "statistics"


async def read_statistics(endpoint: GrpcEndpoint | HttpEndpoint) -> dict[str, pb.ModelStatistics]:
    """Every model's cumulative statistics, by "name" (or "name:version" past the first version)."""
    response = await endpoint.statistics()
    out: dict[str, pb.ModelStatistics] = {}
    for stats in response.model_stats:
        key = stats.name if stats.name not in out else f"{stats.name}:{stats.version}"
        out[key] = stats
    return out


def statistics_delta(
    before: Mapping[str, pb.ModelStatistics], after: Mapping[str, pb.ModelStatistics]
) -> dict[str, dict[str, Any]]:
    """What each model did between two `ModelStatistics` readings, as perf_analyzer reports it.

    Per model with any activity: requests (`inference_count`), executions (`execution_count`), the mean
    batch size (from `batch_stats`, else requests / executions), and the mean time of a successful request
    at the server, queue wait and compute phases per request (from `inference_stats`), in microseconds;
    `batch_sizes` counts executions by batch size.
    """
    report: dict[str, dict[str, Any]] = {}
    for key, a in after.items():
        b = before.get(key) or pb.ModelStatistics()
        inferences = a.inference_count - b.inference_count
        executions = a.execution_count - b.execution_count
        if inferences == 0 and executions == 0:
            continue

        def mean_us(name: str, a: pb.ModelStatistics = a, b: pb.ModelStatistics = b) -> float | None:
            new, old = getattr(a.inference_stats, name), getattr(b.inference_stats, name)
            count = new.count - old.count
            return (new.ns - old.ns) / count / 1e3 if count else None

        old_batches = {s.batch_size: s.compute_infer.count for s in b.batch_stats}
        sizes = {
            int(s.batch_size): s.compute_infer.count - old_batches.get(s.batch_size, 0) for s in a.batch_stats
        }
        sizes = {size: n for size, n in sorted(sizes.items()) if n > 0}
        mean_batch: float | None
        if sizes:
            mean_batch = sum(size * n for size, n in sizes.items()) / sum(sizes.values())
        else:
            mean_batch = inferences / executions if executions else None
        report[key] = {
            "version": a.version,
            "inference_count": inferences,
            "execution_count": executions,
            "success_count": a.inference_stats.success.count - b.inference_stats.success.count,
            "fail_count": a.inference_stats.fail.count - b.inference_stats.fail.count,
            "mean_batch_size": mean_batch,
            "request_us": mean_us("success"),
            "queue_us": mean_us("queue"),
            "compute_input_us": mean_us("compute_input"),
            "compute_infer_us": mean_us("compute_infer"),
            "compute_output_us": mean_us("compute_output"),
            "cache_hits": a.inference_stats.cache_hit.count - b.inference_stats.cache_hit.count,
            "cache_misses": a.inference_stats.cache_miss.count - b.inference_stats.cache_miss.count,
            "batch_sizes": sizes,
        }
    return report


async def read_process_cpu(endpoints: Mapping[str, str]) -> dict[str, float | None]:
    """`process_cpu_seconds_total` of each Prometheus endpoint (name -> /metrics URL); None where it cannot
    be read."""
    from prometheus_client.parser import text_string_to_metric_families

    def read(url: str) -> float | None:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                text = reply.read().decode()
        except (OSError, ValueError):
            return None
        for family in text_string_to_metric_families(text):
            if family.name == "process_cpu_seconds":
                return sum(sample.value for sample in family.samples)
        return None

    values = await asyncio.gather(*(asyncio.to_thread(read, url) for url in endpoints.values()))
    return dict(zip(endpoints, values, strict=True))


async def statistics_over(
    endpoint: GrpcEndpoint | HttpEndpoint, t_meas: float, t_stop: float, settled: Callable[[], bool]
) -> dict[str, dict[str, Any]]:
    """What each model did over the measured interval (`t_meas` to `t_stop`, `time.perf_counter` instants):
    `statistics_delta` of a reading at each end, the second once `settled()` says so."""
    await _sleep_until(t_meas)
    before = await read_statistics(endpoint)
    await _sleep_until(t_stop)
    while not settled():
        await asyncio.sleep(0.01)
    return statistics_delta(before, await read_statistics(endpoint))


async def cpu_over(endpoints: Mapping[str, str], t_meas: float, t_stop: float) -> dict[str, float | None]:
    """The CPU seconds each Prometheus endpoint's process used over the measured interval (`t_meas` to
    `t_stop`, `time.perf_counter` instants); None where either reading failed."""
    if not endpoints:
        return {}
    await _sleep_until(t_meas)
    before = await read_process_cpu(endpoints)
    await _sleep_until(t_stop)
    after = await read_process_cpu(endpoints)
    used: dict[str, float | None] = {}
    for name, old in before.items():
        new = after[name]
        used[name] = None if old is None or new is None else new - old
    return used


async def _sleep_until(instant: float) -> None:
    await asyncio.sleep(max(0.0, instant - time.perf_counter()))

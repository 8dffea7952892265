"""How a dynamic batcher's requests count (`pipeline.router.scheduling.batching`): each batch's execution and
each request's outcome in its model's statistics (Triton's `ModelStatistics`) and the router's metrics. A
request the compiled front merged counts as the clients' requests it carries."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pipeline.protocol.frames import failed_requests
from pipeline.runtime.error_status import outcome_of
from pipeline.runtime.model_statistics import ModelStats

if TYPE_CHECKING:
    from pipeline.runtime.metrics import Metrics


class Queued(Protocol):
    """What is counted of a request that waited in a batcher."""

    size: int
    requests: int
    enqueued: float


def count_failed(stats: ModelStats, pending: Queued, now: float, outcome: str) -> None:
    """A request failed at `now` (on its batcher's clock) with `outcome` (a code's name), counted as the
    requests it carries (`failed_requests`)."""
    failed = failed_requests(pending.requests, outcome)
    if failed:
        stats.request_failed(int((now - pending.enqueued) * 1e9), failed)


def account_batch(
    stats: ModelStats,
    metrics: Metrics | None,
    model: str,
    batch: Sequence[Queued],
    results: Sequence[object],
    now: float,
    finished: float,
    started_ns: int,
) -> None:
    """A batch's execution and each request's outcome, in the model's statistics and metrics: `now` when the
    batch was taken and `finished` when its results came (on its batcher's clock), `started_ns` when its
    execution began (`time.perf_counter_ns`)."""
    compute_ns = time.perf_counter_ns() - started_ns
    size = sum(p.size for p in batch)
    stats.batch_done(size, compute_ns)
    if metrics is not None:
        metrics.batch_size.labels(model).observe(size)
        metrics.compute_duration.labels(model).observe(compute_ns / 1e9)
        queue = metrics.queue_duration.labels(model)
        for pending in batch:
            queue.observe(now - pending.enqueued)  # once per queue entry, a merged one too
    # The successes are counted together, in one call for the batch.
    done = items = total_ns = queue_ns = 0
    for pending, result in zip(batch, results, strict=True):
        if isinstance(result, BaseException):
            count_failed(stats, pending, finished, outcome_of(result))
        else:
            done += pending.requests
            items += pending.size
            total_ns += int((finished - pending.enqueued) * 1e9) * pending.requests
            queue_ns += int((now - pending.enqueued) * 1e9) * pending.requests
    if done:
        stats.requests_done(done, items=items, total_ns=total_ns, queue_ns=queue_ns, compute_ns=compute_ns)

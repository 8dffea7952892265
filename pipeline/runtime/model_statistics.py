"""Per-model counters in the shape of Triton's statistics extension (`ModelStatistics`).

Durations are cumulative nanoseconds, as Triton reports them: `success` is whole requests, `queue` the time
they waited for a batch (or for the model's thread), `compute_input`/`compute_infer`/`compute_output` the
decode, inference and encode times of the execution each rode in (a batch's times count once per request,
as Triton counts them); `batch_stats` counts the
executions of each batch size; `cache_hit` and `cache_miss` count the router's response cache lookups (a
hit is a success without an execution). perf_analyzer reads these for its server-side breakdown.

A decoupled model's responses are counted by their index in their request too, as Triton's `response_stats`
counts them: `compute_infer` the time until the model made the response (from the request's start, or from
its previous response), `compute_output` its encoding, `success` both, `fail` an error response, and
`empty_response` a response that carries the final flag alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pipeline._gen.inference import grpc_service_pb2 as pb


@dataclass(slots=True)
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def proto(self) -> pb.StatisticDuration:
        return pb.StatisticDuration(count=self.count, ns=self.ns)


@dataclass(slots=True)
class _ResponseStats:
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    empty_response: _Duration = field(default_factory=_Duration)

    def proto(self) -> pb.InferResponseStatistics:
        return pb.InferResponseStatistics(
            compute_infer=self.compute_infer.proto(),
            compute_output=self.compute_output.proto(),
            success=self.success.proto(),
            fail=self.fail.proto(),
            empty_response=self.empty_response.proto(),
        )


@dataclass(slots=True)
class ModelStats:
    """What one model has done since the server started."""

    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)
    batches: dict[int, _Duration] = field(default_factory=dict)
    #: Requests answered from the router's response cache, and the time spent looking them up.
    cache_hit: _Duration = field(default_factory=_Duration)
    #: Requests the cache could not answer, and the time spent looking them up and storing their responses.
    cache_miss: _Duration = field(default_factory=_Duration)
    #: A decoupled model's responses, by their index in their request (Triton's `response_stats`).
    responses: dict[int, _ResponseStats] = field(default_factory=dict)
    #: Of `inference_count` and `success`: what the response cache answered (`cache_proto`).
    cache_hit_items: int = 0
    cache_hit_success: _Duration = field(default_factory=_Duration)

    def response_done(self, index: int, *, infer_ns: int, output_ns: int = 0, empty: bool = False) -> None:
        """Response `index` of a request to a decoupled model was made (`empty`: the final flag alone)."""
        response = self.responses.setdefault(index, _ResponseStats())
        if empty:
            response.empty_response.add(infer_ns)
            return
        response.compute_infer.add(infer_ns)
        response.compute_output.add(output_ns)
        response.success.add(infer_ns + output_ns)

    def response_failed(self, index: int, ns: int) -> None:
        """Response `index` of a request to a decoupled model was an error."""
        self.responses.setdefault(index, _ResponseStats()).fail.add(ns)

    def request_done(
        self,
        *,
        items: int,
        total_ns: int,
        queue_ns: int = 0,
        compute_ns: int = 0,
        input_ns: int = 0,
        output_ns: int = 0,
    ) -> None:
        """A request (of `items` batch items) completed successfully."""
        self.requests_done(
            1,
            items=items,
            total_ns=total_ns,
            queue_ns=queue_ns,
            compute_ns=compute_ns,
            input_ns=input_ns,
            output_ns=output_ns,
        )

    def requests_done(
        self,
        requests: int,
        *,
        items: int,
        total_ns: int,
        queue_ns: int = 0,
        compute_ns: int = 0,
        input_ns: int = 0,
        output_ns: int = 0,
    ) -> None:
        """`requests` requests (of `items` batch items in all) completed successfully in one execution:
        `total_ns` and `queue_ns` are their times summed; `compute_ns`, `input_ns` and `output_ns` the
        execution's, which count once for each of them."""
        self.inference_count += items
        self.success.add(total_ns, requests)
        self.queue.add(queue_ns, requests)
        self.compute_input.add(input_ns * requests, requests)
        self.compute_infer.add(compute_ns * requests, requests)
        self.compute_output.add(output_ns * requests, requests)
        self.last_inference_ms = int(time.time() * 1000)

    def cache_hit_done(self, *, items: int, total_ns: int, cache_ns: int) -> None:
        """A request answered from the response cache: a success and an inference, but no execution (as
        Triton counts a hit)."""
        self.inference_count += items
        self.success.add(total_ns)
        self.cache_hit.add(cache_ns)
        self.cache_hit_items += items
        self.cache_hit_success.add(total_ns)
        self.last_inference_ms = int(time.time() * 1000)

    def cache_missed(self, cache_ns: int) -> None:
        """A request the response cache could not answer; it is counted as it runs, as any other."""
        self.cache_miss.add(cache_ns)

    def request_failed(self, total_ns: int, requests: int = 1) -> None:
        """A request failed (refused, timed out in the queue, or its execution failed); `requests` requests
        merged into one, each after `total_ns`."""
        self.fail.add(total_ns * requests, requests)

    def batch_done(self, size: int, compute_ns: int) -> None:
        """One execution of the model on a batch of `size` items."""
        self.execution_count += 1
        self.batches.setdefault(size, _Duration()).add(compute_ns)

    def proto(self, name: str, version: str) -> pb.ModelStatistics:
        return pb.ModelStatistics(
            name=name,
            version=version,
            last_inference=self.last_inference_ms,
            inference_count=self.inference_count,
            execution_count=self.execution_count,
            inference_stats=pb.InferStatistics(
                success=self.success.proto(),
                fail=self.fail.proto(),
                queue=self.queue.proto(),
                compute_input=self.compute_input.proto(),
                compute_infer=self.compute_infer.proto(),
                compute_output=self.compute_output.proto(),
                cache_hit=self.cache_hit.proto(),
                cache_miss=self.cache_miss.proto(),
            ),
            batch_stats=[
                pb.InferBatchStatistics(batch_size=size, compute_infer=d.proto())
                for size, d in sorted(self.batches.items())
            ],
            response_stats={str(index): r.proto() for index, r in sorted(self.responses.items())},
        )

    def cache_proto(self, name: str, version: str) -> pb.ModelStatistics:
        """Only what the response cache did: the requests it answered (their items and their time, as
        inferences and successes), its hits and its misses. A router adds them to a stage model's figures,
        which its replicas give and which never see a hit."""
        return pb.ModelStatistics(
            name=name,
            version=version,
            # The last inference it knows of, once it answered one (a hit's is not kept apart).
            last_inference=self.last_inference_ms if self.cache_hit_items else 0,
            inference_count=self.cache_hit_items,
            inference_stats=pb.InferStatistics(
                success=self.cache_hit_success.proto(),
                cache_hit=self.cache_hit.proto(),
                cache_miss=self.cache_miss.proto(),
            ),
        )


#: The durations of `pb.InferStatistics`, each a count and a sum of nanoseconds.
_INFER_DURATIONS = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)
_RESPONSE_DURATIONS = ("compute_infer", "compute_output", "success", "fail", "empty_response")


def add_statistics(into: pb.ModelStatistics, other: pb.ModelStatistics) -> None:
    """Add `other`'s figures to `into` (one model's, counted by several processes): counts and durations
    summed, executions per batch size and responses per index too, the latest `last_inference`; `into`
    keeps its name and version."""
    into.last_inference = max(into.last_inference, other.last_inference)
    into.inference_count += other.inference_count
    into.execution_count += other.execution_count
    for name in _INFER_DURATIONS:
        _add_duration(getattr(into.inference_stats, name), getattr(other.inference_stats, name))
    sizes = {b.batch_size: (b.compute_infer.count, b.compute_infer.ns) for b in into.batch_stats}
    for batch in other.batch_stats:
        count, ns = sizes.get(batch.batch_size, (0, 0))
        sizes[batch.batch_size] = (count + batch.compute_infer.count, ns + batch.compute_infer.ns)
    del into.batch_stats[:]
    for size, (count, ns) in sorted(sizes.items()):
        into.batch_stats.add(batch_size=size, compute_infer=pb.StatisticDuration(count=count, ns=ns))
    for index, theirs in other.response_stats.items():
        mine = into.response_stats[index]
        for name in _RESPONSE_DURATIONS:
            _add_duration(getattr(mine, name), getattr(theirs, name))


def _add_duration(into: pb.StatisticDuration, other: pb.StatisticDuration) -> None:
    into.count += other.count
    into.ns += other.ns

"""Dynamic batching: requests for one stage model queue here and leave as batches.

The knobs are Triton's `dynamic_batching` ones. A batch is sent as soon as it reaches the largest size it
can (`max_batch_size`, or the largest preferred size the queue can fill), or when its oldest request has
waited `max_queue_delay_microseconds`. With idle dispatch (the default) a batch also goes at once whenever
the stage is idle (no batch of it in flight), taking all that is queued, so a lone request never waits out
the delay. While batches are in flight (several replicas, or `max_inflight_batches` > 1), a free slot does
not send a batch of one: it waits, as in Triton, for the largest preferred size or the delay.

The batcher knows nothing of tensors: the router gives each request a payload, its size (dimension 0),
and a key; only requests with equal keys share a batch. `execute` runs one batch and returns one result
or exception per request, so one bad item fails only its own request.

Tracing: a request may bring its span (the router's step span). A batch then gets one span, a child of its
first member's span and linked to every member's span, current while `execute` runs (so the stage call
carries its context); each member's span gets the batch's size (`pipeline.router.scheduling.batch_spans`). Time is read
from a `pipeline.router.scheduling.clock.Clock`, which tests replace.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from opentelemetry.trace import Span

from pipeline.protocol.errors import DeadlineExceeded, InvalidInput, Unavailable
from pipeline.protocol.frames import failed_requests
from pipeline.protocol.types import BatchingConfig
from pipeline.router.scheduling.batch_accounting import account_batch, count_failed
from pipeline.router.scheduling.batch_spans import batch_span
from pipeline.router.scheduling.clock import Clock, Timer, Wakeups
from pipeline.runtime.model_statistics import ModelStats
from pipeline.runtime.spans import Current

if TYPE_CHECKING:
    from pipeline.runtime.metrics import Metrics
    from pipeline.runtime.telemetry import Telemetry

In = TypeVar("In")
Out = TypeVar("Out")


#: A `_Pending`'s states: waiting in its queue, taken into a batch, or dropped (cancelled, expired).
_QUEUED, _TAKEN, _DROPPED = 0, 1, 2


@dataclass(slots=True, eq=False)
class _Pending(Generic[In, Out]):
    payload: In
    size: int
    key: Hashable
    priority: int
    seq: int
    enqueued: float
    deadline: float | None
    future: asyncio.Future[Out]
    #: How many clients' requests it carries (the compiled front's merged ones): each is counted.
    requests: int = 1
    span: Span | None = None
    state: int = _QUEUED
    timer: Timer | None = None
    #: The batch it was taken into, and the task that runs it.
    batch: tuple[list[_Pending[In, Out]], asyncio.Task[None]] | None = None


class _KeyQueue(Generic[In, Out]):
    """The requests of one batching key: a FIFO per priority level, and the items (dimension 0) and
    requests they hold that are still queued. Dropped requests stay in their FIFO until they reach its head
    (lazy removal), so no request is ever searched for."""

    __slots__ = ("fifos", "items", "requests")

    def __init__(self, levels: int) -> None:
        self.fifos: list[deque[_Pending[In, Out]]] = [deque() for _ in range(levels)]
        self.items = 0
        self.requests = 0

    def heads(self) -> list[_Pending[In, Out]]:
        """The first queued request of each priority level that has one (dropped heads are discarded)."""
        found = []
        for fifo in self.fifos:
            while fifo and fifo[0].state != _QUEUED:
                fifo.popleft()
            if fifo:
                found.append(fifo[0])
        return found


class _Queue(Generic[In, Out]):
    """The requests waiting for a batch: a `_KeyQueue` per batching key, and how many requests they hold in
    all."""

    __slots__ = ("keys", "levels", "requests")

    def __init__(self, levels: int) -> None:
        self.keys: dict[Hashable, _KeyQueue[In, Out]] = {}
        self.levels = levels
        self.requests = 0

    def add(self, pending: _Pending[In, Out]) -> None:
        """Queue a request behind those of its key and priority."""
        queue = self.keys.get(pending.key)
        if queue is None:
            queue = self.keys[pending.key] = _KeyQueue(self.levels)
        queue.fifos[pending.priority].append(pending)
        queue.items += pending.size
        queue.requests += 1
        self.requests += 1

    def drop(self, pending: _Pending[In, Out]) -> None:
        """Take a queued request out of the counts; its FIFO forgets it when it reaches the head."""
        pending.state = _DROPPED
        _cancel_timer(pending)
        queue = self.keys[pending.key]
        queue.items -= pending.size
        queue.requests -= 1
        self.requests -= 1

    def clear(self) -> list[_Pending[In, Out]]:
        """Empty the queue: the requests it held, each marked dropped."""
        dropped = []
        for queue in self.keys.values():
            for fifo in queue.fifos:
                for pending in fifo:
                    if pending.state == _QUEUED:
                        pending.state = _DROPPED
                        _cancel_timer(pending)
                        dropped.append(pending)
        self.keys.clear()
        self.requests = 0
        return dropped

    def by_first(self) -> list[tuple[tuple[int, int], float, _KeyQueue[In, Out]]]:
        """Each key's queue with its first request's (priority, arrival) and its oldest head's enqueue time,
        in the order of their first requests (highest priority, then oldest); a key left empty is forgotten.
        The work is proportional to the number of keys, never to the length of the queue."""
        candidates = []
        for key, queue in list(self.keys.items()):
            heads = queue.heads()
            if not heads:
                del self.keys[key]
                continue
            first = min(heads, key=lambda p: (p.priority, p.seq))
            candidates.append(((first.priority, first.seq), min(p.enqueued for p in heads), queue))
        candidates.sort(key=lambda c: c[0])
        return candidates

    def take(self, queue: _KeyQueue[In, Out], limit: int) -> list[_Pending[In, Out]]:
        """Take requests of one key, highest priority first and in arrival order, up to `limit` items; a
        request that does not fit is passed over (never split) and keeps its place."""
        chosen: list[_Pending[In, Out]] = []
        total = 0
        for fifo in queue.fifos:
            passed: list[_Pending[In, Out]] = []
            # Look at most `limit` requests past the first that does not fit: the work stays bounded.
            budget = limit
            while fifo and total < limit and budget > 0:
                pending = fifo.popleft()
                if pending.state != _QUEUED:
                    continue
                if total + pending.size > limit:
                    passed.append(pending)
                    budget -= 1
                    continue
                chosen.append(pending)
                total += pending.size
            fifo.extendleft(reversed(passed))
            if total >= limit:
                break
        if not chosen:  # a lone request larger than a preferred size: it goes alone
            for fifo in queue.fifos:
                while fifo and not chosen:
                    pending = fifo.popleft()
                    if pending.state == _QUEUED:
                        chosen.append(pending)
        for pending in chosen:
            pending.state = _TAKEN
            _cancel_timer(pending)
            queue.items -= pending.size
            queue.requests -= 1
        self.requests -= len(chosen)
        return chosen


def _cancel_timer(pending: _Pending[In, Out]) -> None:
    if pending.timer is not None:
        pending.timer.cancel()
        pending.timer = None


@dataclass(slots=True)
class QueueCounters:
    """Requests the batcher turned away or dropped before the stage saw them."""

    dropped_deadline: int = 0
    dropped_cancelled: int = 0
    rejected_full: int = 0


def queue_deadline(
    config: BatchingConfig, now: float, grpc_deadline: float | None, timeout_us: int | None
) -> float | None:
    """The earlier of a request's gRPC deadline and its queue timeout at a batcher of `config` (the request's
    `timeout`, in microseconds, or the default), on the batcher's clock (`now`)."""
    timeout = config.default_timeout_microseconds
    if timeout_us is not None and config.allow_timeout_override:
        timeout = timeout_us
    deadlines = [d for d in (grpc_deadline,) if d is not None]
    if timeout > 0:
        deadlines.append(now + timeout / 1e6)
    return min(deadlines) if deadlines else None


def priority_index(config: BatchingConfig, requested: int | None) -> int:
    """The queue index for a request's `priority` (1 is highest) at a batcher of `config`: as Triton takes it,
    none, 0 or one outside 1..priority_levels is the default level."""
    levels = config.priority_levels
    if levels == 0:
        return 0
    if requested is None or not 1 <= requested <= levels:
        return config.default_priority_level - 1
    return requested - 1


class DynamicBatcher(Generic[In, Out]):
    """Queues requests for one stage model and runs them in batches through `execute`.

    Use inside a running event loop: `start()` once, `await submit(...)` per request, `await aclose()`.
    """

    def __init__(
        self,
        name: str,
        execute: Callable[[Sequence[In]], Awaitable[Sequence[Out | BaseException]]],
        config: BatchingConfig,
        *,
        clock: Clock | None = None,
        telemetry: Telemetry | None = None,
        metrics: Metrics | None = None,
        model: str = "",
        replicas: Callable[[], int] | None = None,
    ) -> None:
        """`replicas` says how many replicas of the stage are ready to serve the model now (at least 1 is
        assumed): the batches in flight are `max_inflight_batches` times that. Call `replicas_changed()` when
        it changes."""
        self.name = name
        self._replicas = replicas
        #: The model's name in span attributes and metric labels.
        self.model = model or name
        self._telemetry = telemetry if telemetry is not None and telemetry.enabled else None
        self._metrics = metrics
        self.config = config
        self._execute = execute
        self._clock = clock or Clock()
        self._waiting: _Queue[In, Out] = _Queue(max(1, config.priority_levels))
        #: Requests the router holds that will be submitted here (`expect`), not yet submitted.
        self._upcoming = 0
        self._seq = itertools.count()
        self._inflight: set[asyncio.Task[None]] = set()
        #: Batches executing: the scheduler's tasks and batches of one run by their submitter.
        self._busy = 0
        self._previous_done: asyncio.Future[None] | None = None
        self._draining = False  # set by `drain`: what is queued goes without waiting out its delay
        #: The scheduler: a callback of the event loop, once per wake-up, not a task.
        self._wakeups = Wakeups(self._clock, self._schedule)
        self.stats = ModelStats()
        self.counters = QueueCounters()

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start scheduling, on the running event loop."""
        self._wakeups.start()

    async def aclose(self) -> None:
        """Stop scheduling; queued requests fail with UNAVAILABLE, batches in flight finish."""
        self._wakeups.close()
        for pending in self._waiting.clear():
            if not pending.future.done():
                count_failed(self.stats, pending, self._clock.now(), "UNAVAILABLE")
                pending.future.set_exception(Unavailable(f"{self.name}: shutting down"))
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)

    async def drain(self) -> None:
        """Send every queued request without waiting out its delay, let the batches finish, then stop: the
        batcher of a model loaded again with other settings gives way to a new one."""
        self._draining = True
        self._schedule()
        while self._inflight:
            await asyncio.wait(set(self._inflight), return_when=asyncio.FIRST_COMPLETED)
            self._schedule()
        await self.aclose()

    @property
    def queue_depth(self) -> int:
        return self._waiting.requests

    @property
    def inflight_batches(self) -> int:
        return self._busy

    @property
    def max_inflight(self) -> int:
        """Batches allowed in flight now: `max_inflight_batches` per ready replica."""
        replicas = self._replicas() if self._replicas is not None else 1
        return self.config.max_inflight_batches * max(1, replicas)

    def replicas_changed(self) -> None:
        """The stage's ready replicas changed: a new one may take a queued batch now."""
        self._wake()

    # --- requests ------------------------------------------------------------------------------------

    def deadline_of(self, grpc_deadline: float | None, timeout_us: int | None) -> float | None:
        """A request's deadline in this batcher's queue (see `queue_deadline`)."""
        return queue_deadline(self.config, self._clock.now(), grpc_deadline, timeout_us)

    def expect(self) -> None:
        """Say that a request the router holds will be submitted here (`submit(..., expected=True)`), so
        that a partial batch may wait for it (`batch_upcoming`)."""
        self._upcoming += 1

    def unexpect(self) -> None:
        """An expected request will not be submitted after all (its request failed, or skipped the step)."""
        self._upcoming -= 1
        self._wake()

    async def submit(
        self,
        payload: In,
        *,
        size: int = 1,
        key: Hashable = None,
        deadline: float | None = None,
        priority: int = 0,
        span: Span | None = None,
        expected: bool = False,
        requests: int = 1,
    ) -> Out:
        """Queue one request and wait for its result. `deadline` is on the batcher's clock; `span` is the
        request's span that the batch span links to (ignored with tracing off); `expected`: announced by
        `expect()`; `requests`: how many clients' requests it carries, each counted in the statistics."""
        config = self.config
        if expected and self._upcoming > 0:  # (see `StageBatchers.refit`)
            self._upcoming -= 1
        self._admit(size, requests)
        wakeups = self._wakeups
        if not wakeups.started:
            self.start()
        future: asyncio.Future[Out] = wakeups.loop.create_future()
        now = self._clock.now()
        pending = _Pending(payload, size, key, priority, next(self._seq), now, deadline, future, requests)
        if span is not None and self._telemetry is not None:
            pending.span = span
        if (
            config.idle_dispatch
            and not self._waiting.requests
            and self._busy == 0
            and not (config.batch_upcoming and self._upcoming > 0)
            and not config.preserve_ordering
            and pending.span is None
        ):
            # NOTE: nothing waits and the stage is idle (every request at low load): the batch of one runs in
            # the caller's task, saving the scheduler's wake-up, a task and the futures of a batch.
            if deadline is not None and deadline <= now:
                self.counters.dropped_deadline += 1
                raise DeadlineExceeded(f"{self.name}: the request's deadline passed before it was sent")
            self._busy += 1
            try:
                return await self._execute_one(pending, now)
            finally:
                self._busy -= 1
                self._wake()
        self._waiting.add(pending)
        if deadline is not None:
            pending.timer = self._clock.call_at(deadline, lambda: self._expire(pending))
        self._wake()
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(pending)
            raise

    def _abandon(self, pending: _Pending[In, Out]) -> None:
        """The caller went away (the client cancelled): drop the request before the stage sees it, or cancel
        its batch's stage call once no member's caller waits for it (the stage then frees its instance, and
        cancels the calls its model made, as for an unbatched call)."""
        if pending.state == _QUEUED:
            self._waiting.drop(pending)
            self.counters.dropped_cancelled += 1
        elif pending.batch is not None:
            members, running = pending.batch
            if all(member.future.cancelled() for member in members):
                running.cancel()

    def _admit(self, size: int, requests: int) -> None:
        """Refuse a request of more items than a batch holds, or one that the full queue has no room for."""
        config = self.config
        if size > config.max_batch_size:
            raise InvalidInput(
                f"{self.name}: the request's batch size {size} exceeds max_batch_size {config.max_batch_size}"
            )
        if config.max_queue_size and self._waiting.requests >= config.max_queue_size:
            self.counters.rejected_full += 1
            self.stats.request_failed(0, failed_requests(requests, "UNAVAILABLE"))
            raise Unavailable(
                f"{self.name} is saturated: {self._waiting.requests} requests queued (max_queue_size "
                f"{config.max_queue_size}); retry later"
            )

    def _expire(self, pending: _Pending[In, Out]) -> None:
        """A queued request's deadline came: fail it now, wherever it is in its queue."""
        pending.timer = None
        if pending.state != _QUEUED:
            return
        self._waiting.drop(pending)
        self.counters.dropped_deadline += 1
        count_failed(self.stats, pending, self._clock.now(), "DEADLINE_EXCEEDED")
        if not pending.future.done():
            pending.future.set_exception(
                DeadlineExceeded(f"{self.name}: the request's deadline passed while it was queued")
            )

    # --- scheduling ----------------------------------------------------------------------------------

    def _wake(self) -> None:
        """Have the scheduler look at the queue once the running callback is done."""
        self._wakeups.soon()

    def _schedule(self) -> None:
        """Send every batch that should go now, and look again when the earliest waiting one is due."""
        now = self._clock.now()
        wake_at = None
        while self._waiting.requests and self._busy < self.max_inflight:
            batch, wake_at = self._form(now)
            if batch is None:
                break
            self._dispatch(batch, now)
        self._wakeups.at(wake_at)

    def _form(self, now: float) -> tuple[list[_Pending[In, Out]] | None, float | None]:
        """The batch to send now, or (None, when to look again).

        Keys are considered in the order of their first request (highest priority, then oldest); the first
        key whose batch should go now goes. A key still waiting out its delay does not hold back another
        key's full batch. The work is proportional to the number of keys and the batch's size, never to the
        length of the queue."""
        config = self.config
        largest_preferred = max(config.preferred_batch_size, default=0)
        goal = largest_preferred or config.max_batch_size
        wake_at = None
        # An idle stage (no batch in flight) sends at once (after the requests on their way, up to the
        # largest preferred size) and takes all that is queued, up to max_batch_size. While batches are in
        # flight, a partial batch waits for the largest preferred size or its delay, as in Triton.
        idle = config.idle_dispatch and self._busy == 0
        for _, oldest, queue in self._waiting.by_first():
            if queue.items >= config.max_batch_size:
                return self._waiting.take(queue, config.max_batch_size), None
            if largest_preferred and not idle and queue.items >= largest_preferred:
                return self._waiting.take(queue, largest_preferred), None
            due = oldest + config.max_delay
            # NOTE: the same expression decides and schedules, so a wake-up at that time always sends.
            if now >= due or self._draining:
                return self._waiting.take(queue, config.max_batch_size), None
            if idle:
                awaited = min(goal, queue.items + self._upcoming) if config.batch_upcoming else 0
                if queue.items >= awaited:
                    return self._waiting.take(queue, config.max_batch_size), None
            wake_at = due if wake_at is None else min(wake_at, due)
        return None, wake_at

    def _chain(self) -> tuple[asyncio.Future[None] | None, asyncio.Future[None]]:
        """The previous batch's completion to wait for (with preserve_ordering), and this batch's."""
        previous = self._previous_done if self.config.preserve_ordering else None
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._previous_done = done
        return previous, done

    def _dispatch(self, batch: list[_Pending[In, Out]], now: float) -> None:
        task = asyncio.create_task(self._execute_batch(batch, now, *self._chain()))
        for pending in batch:
            pending.batch = (batch, task)
        self._busy += 1
        self._inflight.add(task)
        task.add_done_callback(self._batch_finished)

    def _batch_finished(self, task: asyncio.Task[None]) -> None:
        self._busy -= 1
        self._inflight.discard(task)
        self._wake()

    async def _execute_batch(
        self,
        batch: list[_Pending[In, Out]],
        now: float,
        previous: asyncio.Future[None] | None,
        done: asyncio.Future[None],
    ) -> None:
        size = sum(p.size for p in batch)
        span = _batch_span(self._telemetry, self.model, batch, size) if self._telemetry is not None else None
        started = time.perf_counter_ns()
        try:
            if span is None:
                results = await self._execute([p.payload for p in batch])
            else:
                with Current(span):
                    results = await self._execute([p.payload for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(
                    f"{self.name}: execute returned {len(results)} results for {len(batch)} requests"
                )
        except asyncio.CancelledError:
            for pending in batch:
                pending.future.cancel()
                pending.batch = None
            done.set_result(None)
            raise
        except Exception as err:  # every member must hear of the failure
            results = [err] * len(batch)
        account_batch(self.stats, self._metrics, self.model, batch, results, now, self._clock.now(), started)
        try:
            if previous is not None:
                await asyncio.shield(previous)
            _deliver(batch, results)
        finally:
            if not done.done():
                done.set_result(None)
            for pending in batch:
                pending.batch = None  # no cycle keeps the batch's tensors

    async def _execute_one(self, pending: _Pending[In, Out], now: float) -> Out:
        """Run a batch of one request in the caller's task: its result, or its error raised."""
        started = time.perf_counter_ns()
        try:
            (result,) = await self._execute([pending.payload])
        except Exception as err:  # the request hears of it; a cancellation goes on up
            result = err
        account_batch(
            self.stats, self._metrics, self.model, [pending], [result], now, self._clock.now(), started
        )
        if isinstance(result, BaseException):
            raise result
        return result


def _batch_span(telemetry: Telemetry, model: str, batch: list[_Pending[In, Out]], size: int) -> Span | None:
    """Start a batch's span (see `batch_spans`); None when no member is traced."""
    members = [p.span for p in batch if p.span is not None]
    if not members:
        return None
    tracer = telemetry.tracer
    assert tracer is not None
    return batch_span(tracer, model, members, size, len(batch))


def _deliver(batch: Sequence[_Pending[In, Out]], results: Sequence[Out | BaseException]) -> None:
    """Give each member of a batch its result, or its error, unless its caller has gone (cancelled)."""
    for pending, result in zip(batch, results, strict=True):
        if pending.future.done():
            continue
        if isinstance(result, BaseException):
            pending.future.set_exception(result)
        else:
            pending.future.set_result(result)

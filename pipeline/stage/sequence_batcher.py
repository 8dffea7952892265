"""Triton's sequence batcher, on the stage service that runs a stateful model (`sequence_batching` in its
`config.pbtxt`).

A client sends a sequence's requests with the request parameters `sequence_id` (a number or a string),
`sequence_start` on the first and `sequence_end` on the last. Every instance of the model has a number of
sequence slots (its `max_batch_size`, or `oldest.max_candidate_sequences`); a starting sequence takes a free
slot, on the instance with the most free ones, and keeps it to its end; a sequence that finds none waits in a
backlog, in order, until one frees (at most `pipeline.max_sequence_backlog` sequences wait, a config
parameter; a START past them is refused at once with UNAVAILABLE), or until the shortest `timeout` of its
requests there has passed, when they are all answered UNAVAILABLE as Triton answers them. Each instance runs one batch at a time,
made of at most one request of each sequence holding one of its slots, so that a sequence's requests run in
order, one at a time, on one instance:

- `direct`: a sequence's request always takes its slot's row of the batch; rows of slots without a request
  are padding (READY false, inputs zero) up to the last row in use. The batch waits up to
  `max_queue_delay_microseconds` for `minimum_slot_utilization` of the slots to have a request.
- `oldest`: Triton's dynamic batcher over the requests of the instance's sequences that may run (`take`):
  the next batch forms while the instance runs one, from the time each request may run (after the one before
  it in its sequence), up to a `preferred_batch_size` within `max_queue_delay_microseconds`, and takes what
  comes while it waits for the instance, in the order the requests may run (the next requests of a batch in
  the batch's order: the one a full batch leaves out is first in the next).

A request whose deadline passes before it runs is answered then, wherever it waits, and ends its sequence,
as a cancelled request ends one in Triton: the sequence leaves its slot or the backlog at once.

Requests of different shapes never share a batch. The model gets the control inputs its config names
(`CONTROL_SEQUENCE_START`, `_END`, `_READY` in their `int32_false_true`, `fp32_false_true` or
`bool_false_true` forms, `_CORRID` in its `data_type`), and where the config declares `state`, each
sequence's state tensors as inputs: `initial_state` (zeros, or the `data_file` under the model's
`initial_state/` folder) on its first request, then what the model returned as the state output the request
before. A sequence idle for `max_sequence_idle_microseconds` (default one second) is released, and its next
request, like any first request without `sequence_start`, is refused with Triton's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pipeline.protocol.errors import (
    DeadlineExceeded,
    InvalidInput,
    PipelineError,
    Unavailable,
)
from pipeline.protocol.sequence_line import in_line
from pipeline.protocol.sequences import SequenceId
from pipeline.stage.api import Deadline
from pipeline.stage.sequence_config import CONTROL, MAX_BACKLOG_PARAMETER, SequenceSettings
from pipeline.stage.sequence_oldest import take
from pipeline.stage.sequence_rows import Row, add_inputs, corrid, merge_rows, no_state, one_row

log = logging.getLogger(__name__)

#: The order requests become eligible to run in (`_Pending.turn`).
_TURNS = itertools.count(1)

#: The answer to a request whose deadline passed while it waited.
NOT_RUN = "deadline exceeded before sequence {sequence}'s request to model '{model}' started: it was not run"
#: The answer to the requests of a sequence that waited for a slot past their `timeout` (Triton's words first).
BACKLOG_TIMEOUT = (
    "timeout of the corresponding sequence has been expired: sequence {sequence} of model '{model}' waited for "
    "a sequence slot longer than its requests' timeout"
)
#: Logged for a START of a sequence that has not ended (Triton's warning).
CONFLICT = (
    "sequence %s for model '%s' has a conflict: the previous sequence did not end before this sequence start; "
    "the previous sequence is ended early"
)


class Runner(Protocol):
    """Runs one batch on one instance: `index` names the instance; the result is each row's outputs, or the
    error that row is answered with, and the batch's compute time (ns)."""

    async def __call__(
        self, index: int, merged: dict[str, np.ndarray], rows: list[Row], deadline: Deadline
    ) -> tuple[list[dict[str, np.ndarray] | PipelineError], int]: ...


@dataclass(eq=False)
class _Pending:
    arrays: dict[str, np.ndarray]
    sequence: SequenceId
    deadline: Deadline
    enqueued: int
    future: asyncio.Future[tuple[dict[str, np.ndarray], int, int]]
    #: Requests of the same shapes may share a batch.
    key: tuple[tuple[str, tuple[int, ...]], ...]
    #: When it became the next request of its sequence to run (`time.perf_counter_ns`): the oldest strategy's
    #: delay counts from here, as Triton's does (a request queued behind its sequence's running one waits
    #: for that one first).
    eligible: int = 0
    #: Its place among the requests that may run (Triton's dynamic batcher's queue): the order they became
    #: eligible in, a batch's next requests in the batch's order, so the one a full batch leaves out is
    #: first in the next.
    turn: int = 0
    #: Answers it when its deadline passes while it waits.
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Sequence:
    value: int | str
    queue: deque[_Pending] = field(default_factory=deque)
    #: (instance, slot) it holds; None while in the backlog.
    slot: tuple[int, int] | None = None
    state: dict[str, np.ndarray] | None = None
    last: float = 0.0
    #: Its END request is queued (or it was ended early): it leaves its slot once nothing of it is left.
    ended: bool = False
    #: One of its requests is in the batch an instance runs.
    running: bool = False
    #: In the backlog: ends it once it has waited the shortest `timeout` of its requests (Triton's).
    expiry: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Instance:
    slots: list[_Sequence | None]
    busy: bool = False
    #: The oldest strategy's next batch, chosen while the instance runs one (Triton's waiting payload): it
    #: takes the requests that come until it is `full`, and runs as soon as the instance is idle.
    next: list[_Sequence] = field(default_factory=list)
    full: bool = False


class SequenceBatcher:
    """The sequence batcher of one model version (see the module docstring). `run` executes a batch on an
    instance; `observe(rows, compute_ns)` hears of every batch run."""

    def __init__(
        self,
        model: str,
        settings: SequenceSettings,
        instances: int,
        run: Runner,
        *,
        observe: Callable[[int, int], None] = lambda rows, compute_ns: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.settings = settings
        self._run = run
        self._observe = observe
        self._clock = clock
        self._instances = [_Instance([None] * settings.slots) for _ in range(instances)]
        #: The sequences that take requests: holding a slot or in the backlog, by id.
        self._sequences: dict[int | str, _Sequence] = {}
        #: The sequences waiting for a slot, oldest first.
        self._backlog: OrderedDict[_Sequence, None] = OrderedDict()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._closed = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._schedule(), name=f"sequences-{self.model}"
            )

    async def close(self) -> None:
        """Stop: requests still queued are answered UNAVAILABLE."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sequence in [*self._sequences.values(), *self._backlog]:
            _fail_queue(sequence, Unavailable(f"model '{self.model}' was unloaded"))

    async def infer(
        self, sequence: SequenceId, arrays: dict[str, np.ndarray], deadline: Deadline
    ) -> tuple[dict[str, np.ndarray], int, int]:
        """Queue one request of a sequence and wait for its outputs: (outputs, queue ns, compute ns)."""
        if self._closed:
            raise Unavailable(f"model '{self.model}' is not loaded")
        self.start()
        for control in self.settings.controls:
            if control.kind == CONTROL.CONTROL_SEQUENCE_CORRID:
                corrid(control, sequence, self.model)  # refuse an id the model cannot take, before queuing
        held = self._sequence_of(sequence)
        held.last = self._clock()
        if sequence.end:
            # Its next request, if any, starts a new sequence.
            held.ended = True
            del self._sequences[sequence.value]
        key = tuple((name, array.shape) for name, array in arrays.items())
        now = time.perf_counter_ns()
        pending = _Pending(arrays, sequence, deadline, now, asyncio.get_running_loop().create_future(), key)
        if not (held.queue or held.running):
            _may_run(pending, now)  # one behind its sequence's others may run once they have
        held.queue.append(pending)
        if sequence.timeout_us and held in self._backlog:
            _arm_backlog(held, sequence.timeout_us, self._backlog_expired)
        in_line()  # the stream's next request of the sequence may come now: it queues behind this one
        _arm(pending, self._expire, held)
        self._wake.set()
        try:
            return await pending.future
        except asyncio.CancelledError:
            # As Triton: a request given up before it ran ends its sequence (its state would miss a step).
            if pending in held.queue:
                self._end(held, pending, None)
            raise

    def _sequence_of(self, sequence: SequenceId) -> _Sequence:
        """The sequence a request belongs to; a START without one starts it, in a free slot or the backlog
        (refused with UNAVAILABLE where the backlog is full)."""
        held = self._sequences.get(sequence.value)
        if held is not None:
            if sequence.start:
                log.warning(CONFLICT, sequence.value, self.model)
            return held
        if not sequence.start:
            raise InvalidInput(
                f"inference request for sequence {sequence.value} to model '{self.model}' must specify the "
                "START flag on the first request of the sequence"
            )
        slot = _free_slot(self._instances)
        if slot is None and len(self._backlog) >= self.settings.max_backlog:
            raise _backlog_full(
                self.model, sequence, self.settings.slots * len(self._instances), len(self._backlog)
            )
        held = _Sequence(sequence.value)
        self._sequences[sequence.value] = held
        if slot is None:
            self._backlog[held] = None
        else:
            held.slot = slot
            self._instances[slot[0]].slots[slot[1]] = held
        return held

    def _release(self, sequence: _Sequence) -> None:
        """Free a sequence's slot and give it to the first sequence of the backlog."""
        if sequence.slot is None:
            return
        index, slot = sequence.slot
        sequence.slot = None
        instance = self._instances[index]
        instance.slots[slot] = None
        if sequence in instance.next:
            instance.next.remove(sequence)
        if self._backlog:
            waiting, _ = self._backlog.popitem(last=False)
            if waiting.expiry is not None:
                waiting.expiry.cancel()  # the timeout of a sequence's requests bounds its wait for a slot only
            waiting.slot = (index, slot)
            instance.slots[slot] = waiting
            _may_run(waiting.queue[0], time.perf_counter_ns())  # its requests may run from now

    def _backlog_expired(self, sequence: _Sequence) -> None:
        """A sequence waited for a slot past its requests' `timeout`: each is answered as Triton answers it."""
        if sequence in self._backlog:
            del self._backlog[sequence]
            error = BACKLOG_TIMEOUT.format(sequence=sequence.value, model=self.model)
            _fail_queue(sequence, Unavailable(error))
            self._forget(sequence)

    def _expire(self, sequence: _Sequence, pending: _Pending) -> None:
        """A waiting request's deadline came: answer it now, wherever it waits, and end its sequence."""
        pending.timer = None
        if pending not in sequence.queue:
            return  # it runs, or was answered
        if not pending.deadline.expired():
            _arm(pending, self._expire, sequence)  # the deadline's clock is behind the loop's
            return
        self._end(
            sequence, pending, DeadlineExceeded(NOT_RUN.format(sequence=sequence.value, model=self.model))
        )

    def _end(self, sequence: _Sequence, given_up: _Pending, error: PipelineError | None) -> None:
        """End a sequence one of whose requests was given up before it ran (Triton ends a sequence whose
        request is cancelled): that request gets `error`, the ones queued after it an error that says why,
        and the sequence leaves its slot or the backlog; its next request without START is refused."""
        if error is not None and not given_up.future.done():
            given_up.future.set_exception(error)
        sequence.queue.remove(given_up)
        _fail_queue(
            sequence,
            Unavailable(
                f"sequence {sequence.value} of model '{self.model}' was ended: a request of it before this one "
                "was given up before it ran; start the sequence again (sequence_start)"
            ),
        )
        self._forget(sequence)
        self._backlog.pop(sequence, None)
        if not sequence.running:
            self._release(sequence)
        self._wake.set()

    # ---- scheduling ------------------------------------------------------------------------------------------

    async def _schedule(self) -> None:
        """Form batches for idle instances as requests come and batches end; release idle sequences."""
        while not self._closed:
            wait = min(self._dispatch(), self._reap())
            self._wake.clear()
            # NOTE: `asyncio.timeout`, not `wait_for`: on Python 3.11 `wait_for` drops a cancellation that comes
            # as the event is set, and `close` would wait for this loop forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if wait == float("inf") else max(wait, 0.0005)):
                    await self._wake.wait()

    def _reap(self) -> float:
        """Release every sequence that has held a slot idle longer than `max_sequence_idle_microseconds`, at
        once; seconds until the next may be. (A sequence in the backlog has a request waiting: never idle.)"""
        now = self._clock()
        idle, soonest = _idle(self._instances, now, self.settings.idle_s)
        for sequence in idle:
            log.info(
                "sequence %s of model '%s' idle for %.3f s (max_sequence_idle_microseconds): released",
                sequence.value,
                self.model,
                now - sequence.last,
            )
            self._forget(sequence)
            self._release(sequence)
        return soonest

    def _forget(self, sequence: _Sequence) -> None:
        """A sequence ends: its next request without START is refused."""
        if self._sequences.get(sequence.value) is sequence:
            del self._sequences[sequence.value]
        sequence.ended = True

    def _dispatch(self) -> float:
        """Start a batch on each idle instance that has one ready; seconds until one may become ready."""
        soonest = float("inf")
        now = time.perf_counter_ns()
        for index, instance in enumerate(self._instances):
            if self.settings.strategy == "oldest":
                wait = self._gather(instance, now)
                picked: list[_Sequence | None] | None = list(instance.next) if instance.next else None
            elif instance.busy:
                continue
            else:
                picked, wait = _direct(instance, self.settings, now)
            if instance.busy or picked is None:
                soonest = min(soonest, wait)
                continue
            instance.busy = True
            instance.next, instance.full = [], False
            taken = [None if sequence is None else _take_head(sequence) for sequence in picked]
            task = asyncio.get_running_loop().create_task(self._execute(index, instance, taken))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            if self.settings.strategy == "oldest":  # the next batch forms while this one runs
                soonest = min(soonest, self._gather(instance, now))
        return soonest

    def _gather(self, instance: _Instance, now: int) -> float:
        """The oldest strategy: add to the instance's next batch what Triton's dynamic batcher would
        (`take`), from its sequences' requests that may run, oldest first; seconds until that may change."""
        settings = self.settings
        rules = (settings.preferred, settings.max_batch_size, settings.delay_s)
        wait = float("inf")
        while not instance.full:
            ready = _ready(instance)
            if not ready:
                return float("inf")
            # Requests of other shapes than the batch's wait for a batch of their own.
            key = instance.next[0].queue[0].key if instance.next else ready[0].queue[0].key
            fitting = [s for s in ready if s.queue[0].key == key]
            left = settings.delay_s - (now - fitting[0].queue[0].eligible) / 1e9
            # A busy instance's batch sees the requests one at a time, as they come (Triton's batcher looks at
            # its queue as each one comes, while its instance runs): it takes the first that make it grow;
            # an idle instance's sees all that wait.
            for seen in range(1 if instance.busy else len(fitting), len(fitting) + 1):
                count, instance.full, wait = take(len(instance.next), seen, *rules, left)
                if count or instance.full:
                    break
            instance.next.extend(fitting[:count])
            if not count or not instance.busy:
                break  # an idle instance runs the batch now; a busy one's grows until it is idle
        return wait

    async def _execute(
        self, index: int, instance: _Instance, taken: list[tuple[_Sequence, _Pending] | None]
    ) -> None:
        try:
            await self._run_batch(index, taken)
        finally:
            now = time.perf_counter_ns()
            for item in taken:
                if item is None:
                    continue
                sequence = item[0]
                sequence.running = False
                if sequence.queue:
                    _may_run(sequence.queue[0], now)
                elif sequence.ended:
                    self._release(sequence)
            if self.settings.strategy == "oldest":
                # The batch's sequences' next requests come to the waiting batch before the instance takes it,
                # as Triton's come while its instance releases the requests it ran.
                self._gather(instance, now)
            instance.busy = False
            self._wake.set()

    async def _run_batch(self, index: int, taken: list[tuple[_Sequence, _Pending] | None]) -> None:
        settings = self.settings
        first = next(item[1] for item in taken if item is not None)
        started = time.perf_counter_ns()
        rows: list[Row] = []
        for item in taken:
            if item is None:
                arrays = {name: np.zeros_like(array) for name, array in first.arrays.items()}
                rows.append(Row(add_inputs(settings, self.model, arrays, None, None), 0, 0))
                continue
            sequence, pending = item
            if pending.sequence.start or sequence.state is None:
                sequence.state = {s.input_name: s.initial for s in settings.states}
            arrays = add_inputs(settings, self.model, dict(pending.arrays), pending.sequence, sequence.state)
            rows.append(Row(arrays, pending.sequence.value, pending.sequence.flags))
        live = [item for item in taken if item is not None]
        merged = merge_rows([row.inputs for row in rows], settings.batching)
        try:
            results, compute_ns = await self._run(index, merged, rows, _batch_deadline(live))
        except Exception as exc:
            for _, pending in live:
                if not pending.future.done():
                    pending.future.set_exception(exc)
            return
        self._observe(len(live), compute_ns)
        for item, result in zip(taken, results, strict=True):
            if item is None:
                continue
            sequence, pending = item
            if pending.future.done():
                continue
            if isinstance(result, PipelineError):
                pending.future.set_exception(result)
                continue
            missing = [s.output_name for s in settings.states if s.output_name not in result]
            if missing:
                pending.future.set_exception(no_state(self.model, missing, pending.sequence))
                continue
            sequence.state = {
                s.input_name: one_row(result[s.output_name], settings.batching) for s in settings.states
            }
            sequence.last = self._clock()
            pending.future.set_result((result, started - pending.enqueued, compute_ns))


def _direct(
    instance: _Instance, settings: SequenceSettings, now: int
) -> tuple[list[_Sequence | None] | None, float]:
    """The direct strategy: each sequence in its own slot's row, None for padding; or None and the
    seconds to wait (for `minimum_slot_utilization` of the slots, at most the delay)."""
    ready = [s for s in instance.slots if s is not None and s.queue]
    if not ready:
        return None, float("inf")
    oldest = min(ready, key=lambda s: s.queue[0].enqueued)
    key = oldest.queue[0].key
    fitting = [s for s in ready if s.queue[0].key == key]
    left = settings.delay_s - (now - oldest.queue[0].enqueued) / 1e9
    used = len(fitting) / len(instance.slots)
    if left > 0 and used < settings.minimum_slot_utilization:
        return None, left
    chosen = set(map(id, fitting))
    last = max(i for i, s in enumerate(instance.slots) if s is not None and id(s) in chosen)
    return [s if s is not None and id(s) in chosen else None for s in instance.slots[: last + 1]], 0.0


def _may_run(pending: _Pending, now: int) -> None:
    """`pending` is its sequence's next request to run from `now`: it joins the line of those that may."""
    pending.eligible = now
    pending.turn = next(_TURNS)


def _arm_backlog(sequence: _Sequence, timeout_us: int, expired: Callable[[_Sequence], None]) -> None:
    """Have `expired` called once a sequence in the backlog has waited `timeout_us`, unless an earlier request
    of it has it called sooner."""
    loop = asyncio.get_running_loop()
    at = loop.time() + timeout_us / 1e6
    if sequence.expiry is None or at < sequence.expiry.when():
        if sequence.expiry is not None:
            sequence.expiry.cancel()
        sequence.expiry = loop.call_at(at, expired, sequence)


def _idle(instances: list[_Instance], now: float, idle_s: float) -> tuple[list[_Sequence], float]:
    """The sequences that have held a slot idle for `idle_s` by `now`, and the seconds until the next may."""
    idle, soonest = [], idle_s
    for instance in instances:
        for sequence in instance.slots:
            if sequence is None or sequence.queue or sequence.running:
                continue
            left = sequence.last + idle_s - now
            if left > 0:
                soonest = min(soonest, left)
            else:
                idle.append(sequence)
    return idle, soonest


def _take_head(sequence: _Sequence) -> tuple[_Sequence, _Pending]:
    pending = sequence.queue.popleft()
    if pending.timer is not None:
        pending.timer.cancel()
        pending.timer = None
    sequence.running = True
    return sequence, pending


def _fail_queue(sequence: _Sequence, error: PipelineError) -> None:
    while sequence.queue:
        pending = sequence.queue.popleft()
        if pending.timer is not None:
            pending.timer.cancel()
        if not pending.future.done():
            pending.future.set_exception(error)


def _free_slot(instances: list[_Instance]) -> tuple[int, int] | None:
    """A free slot, on the instance with the most (None: every slot is held)."""
    best: tuple[int, int] | None = None
    most = 0
    for index, instance in enumerate(instances):
        free = [i for i, s in enumerate(instance.slots) if s is None]
        if len(free) > most:
            best, most = (index, free[0]), len(free)
    return best


def _arm(pending: _Pending, expire: Callable[[_Sequence, _Pending], None], sequence: _Sequence) -> None:
    """Have `expire` called when the deadline of a waiting request passes."""
    left = pending.deadline.remaining()
    if left is not None:
        pending.timer = asyncio.get_running_loop().call_later(left, expire, sequence, pending)


def _ready(instance: _Instance) -> list[_Sequence]:
    """The sequences of an instance whose next request may join its next batch, oldest first."""
    taken = set(map(id, instance.next))
    ready = [
        s
        for s in instance.slots
        if s is not None and s.queue and not s.running and id(s) not in taken and s.queue[0].eligible
    ]
    ready.sort(key=lambda s: s.queue[0].turn)
    return ready


def _backlog_full(model: str, sequence: SequenceId, slots: int, waiting: int) -> Unavailable:
    return Unavailable(
        f"Exceeds maximum queue size: sequence {sequence.value} cannot start on model '{model}': its {slots} "
        f"sequence slot(s) are held and {waiting} sequence(s) wait for one ({MAX_BACKLOG_PARAMETER}); retry later"
    )


def _batch_deadline(live: list[tuple[_Sequence, _Pending]]) -> Deadline:
    """A batch's deadline: its latest request's (none where one of them has none)."""
    ats = [p.deadline.at for _, p in live]
    return Deadline(None if None in ats else max(a for a in ats if a is not None))

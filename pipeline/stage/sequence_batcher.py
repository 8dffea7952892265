"""Triton's sequence batcher, on the stage service that runs a stateful model (`sequence_batching` in its
`config.pbtxt`).

A client sends a sequence's requests with the request parameters `sequence_id` (a number or a string),
`sequence_start` on the first and `sequence_end` on the last. Every instance of the model has a number of
sequence slots (its `max_batch_size`, or `oldest.max_candidate_sequences`); a starting sequence takes a free
slot, on the instance with the most free ones, and keeps it to its end; a sequence that finds none waits in a
backlog, in order, until one frees. Each instance runs one batch at a time, made of at most one request of
each sequence holding one of its slots, so that a sequence's requests run in order, one at a time, on one
instance:

- `direct`: a sequence's request always takes its slot's row of the batch; rows of slots without a request
  are padding (READY false, inputs zero) up to the last row in use. The batch waits up to
  `max_queue_delay_microseconds` for `minimum_slot_utilization` of the slots to have a request.
- `oldest`: the oldest requests of the instance's sequences, as many as `max_batch_size` takes; the batch
  waits up to `max_queue_delay_microseconds` for a `preferred_batch_size` (or the largest).

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
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pipeline.protocol.datatypes import DATATYPES
from pipeline.protocol.errors import (
    DeadlineExceeded,
    InvalidInput,
    PipelineError,
    Unavailable,
)
from pipeline.protocol.sequences import SequenceId
from pipeline.stage.api import Deadline
from pipeline.stage.sequence_config import CONTROL, Control, SequenceSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    """One request of a batch as the model's code sees it: its inputs (one row each, control and state
    inputs included), its sequence id and Triton's request flags."""

    inputs: dict[str, np.ndarray]
    correlation_id: int | str
    flags: int


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


@dataclass(eq=False)
class _Sequence:
    value: int | str
    queue: deque[_Pending] = field(default_factory=deque)
    #: (instance, slot) it holds; None while in the backlog.
    slot: tuple[int, int] | None = None
    state: dict[str, np.ndarray] | None = None
    last: float = 0.0
    #: Its END request is queued: it leaves its slot once that has run.
    ended: bool = False


@dataclass(eq=False)
class _Instance:
    slots: list[_Sequence | None]
    busy: bool = False


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
        self._backlog: deque[_Sequence] = deque()
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
            self._fail_queue(sequence, Unavailable(f"model '{self.model}' was unloaded"))

    async def infer(
        self, sequence: SequenceId, arrays: dict[str, np.ndarray], deadline: Deadline
    ) -> tuple[dict[str, np.ndarray], int, int]:
        """Queue one request of a sequence and wait for its outputs: (outputs, queue ns, compute ns)."""
        if self._closed:
            raise Unavailable(f"model '{self.model}' is not loaded")
        self.start()
        now = self._clock()
        held = self._sequences.get(sequence.value)
        for control in self.settings.controls:
            if control.kind == CONTROL.CONTROL_SEQUENCE_CORRID:
                _corrid(control, sequence, self.model)  # refuse an id the model cannot take, before queuing
        if held is None:
            if not sequence.start:
                raise InvalidInput(
                    f"inference request for sequence {sequence.value} to model '{self.model}' must specify the "
                    "START flag on the first request of the sequence"
                )
            held = _Sequence(sequence.value)
            self._sequences[sequence.value] = held
            self._place(held)
        elif sequence.start:
            log.warning(
                "sequence %s for model '%s' has a conflict: the previous sequence did not end before this "
                "sequence start; the previous sequence is ended early",
                sequence.value,
                self.model,
            )
        held.last = now
        if sequence.end:
            # Its next request, if any, starts a new sequence.
            held.ended = True
            del self._sequences[sequence.value]
        key = tuple((name, array.shape) for name, array in arrays.items())
        future: asyncio.Future[tuple[dict[str, np.ndarray], int, int]] = (
            asyncio.get_running_loop().create_future()
        )
        pending = _Pending(arrays, sequence, deadline, time.perf_counter_ns(), future, key)
        held.queue.append(pending)
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            if pending in held.queue:
                held.queue.remove(pending)
            raise

    def _place(self, sequence: _Sequence) -> None:
        """Give a starting sequence a free slot, on the instance with the most, else the backlog."""
        best: tuple[int, int] | None = None
        most = 0
        for index, instance in enumerate(self._instances):
            free = [i for i, s in enumerate(instance.slots) if s is None]
            if len(free) > most:
                best, most = (index, free[0]), len(free)
        if best is None:
            self._backlog.append(sequence)
            return
        sequence.slot = best
        self._instances[best[0]].slots[best[1]] = sequence

    def _release(self, sequence: _Sequence) -> None:
        """Free a sequence's slot and give it to the first sequence of the backlog."""
        if sequence.slot is None:
            return
        index, slot = sequence.slot
        sequence.slot = None
        self._instances[index].slots[slot] = None
        while self._backlog:
            waiting = self._backlog.popleft()
            if waiting.queue or not waiting.ended:
                waiting.slot = (index, slot)
                self._instances[index].slots[slot] = waiting
                return

    def _fail_queue(self, sequence: _Sequence, error: PipelineError) -> None:
        while sequence.queue:
            pending = sequence.queue.popleft()
            if not pending.future.done():
                pending.future.set_exception(error)

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
        """Release sequences idle longer than `max_sequence_idle_microseconds`; seconds until the next may be."""
        now = self._clock()
        idle = self.settings.idle_s
        soonest = idle
        for value, sequence in list(self._sequences.items()):
            if sequence.queue or self._in_flight(sequence):
                continue
            left = sequence.last + idle - now
            if left > 0:
                soonest = min(soonest, left)
                continue
            log.info(
                "sequence %s of model '%s' idle for %.3f s (max_sequence_idle_microseconds): released",
                value,
                self.model,
                now - sequence.last,
            )
            del self._sequences[value]
            sequence.ended = True
            if sequence in self._backlog:
                self._backlog.remove(sequence)
            self._release(sequence)
        return soonest

    def _in_flight(self, sequence: _Sequence) -> bool:
        return sequence.slot is not None and self._instances[sequence.slot[0]].busy

    def _dispatch(self) -> float:
        """Start a batch on each idle instance that has one ready; seconds until one may become ready."""
        soonest = float("inf")
        now = time.perf_counter_ns()
        for index, instance in enumerate(self._instances):
            if instance.busy:
                continue
            self._drop_expired(instance)
            picked, wait = self._form(instance, now)
            if picked is None:
                soonest = min(soonest, wait)
                continue
            instance.busy = True
            task = asyncio.get_running_loop().create_task(self._execute(index, instance, picked))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        return soonest

    def _drop_expired(self, instance: _Instance) -> None:
        for sequence in instance.slots:
            while sequence is not None and sequence.queue and sequence.queue[0].deadline.expired():
                pending = sequence.queue.popleft()
                if not pending.future.done():
                    pending.future.set_exception(
                        DeadlineExceeded(
                            f"deadline exceeded before sequence {pending.sequence.value}'s request to model "
                            f"'{self.model}' started: it was not run"
                        )
                    )
            if sequence is not None and not sequence.queue and sequence.ended:
                self._release(sequence)

    def _form(self, instance: _Instance, now: int) -> tuple[list[_Sequence | None] | None, float]:
        """The rows of the next batch of an idle instance (a sequence per row, None for padding), or None
        and the seconds to wait for one."""
        settings = self.settings
        ready = [s for s in instance.slots if s is not None and s.queue]
        if not ready:
            return None, float("inf")
        oldest = min(ready, key=lambda s: s.queue[0].enqueued)
        key = oldest.queue[0].key
        fitting = [s for s in ready if s.queue[0].key == key]
        waited = (now - oldest.queue[0].enqueued) / 1e9
        left = settings.delay_s - waited
        rows = settings.max_batch_size
        if settings.strategy == "oldest":
            fitting.sort(key=lambda s: s.queue[0].enqueued)
            # As Triton's dynamic batcher: a preferred size reached goes at once (past the largest, that size).
            largest = max(settings.preferred, default=rows)
            if len(fitting) >= largest:
                return list[_Sequence | None](fitting[:largest]), 0.0
            if len(fitting) in settings.preferred or left <= 0:
                return list[_Sequence | None](fitting[:rows]), 0.0
            return None, left
        # direct: each sequence in its own slot's row.
        used = len(fitting) / len(instance.slots)
        if left > 0 and used < settings.minimum_slot_utilization:
            return None, left
        chosen = set(map(id, fitting))
        last = max(i for i, s in enumerate(instance.slots) if s is not None and id(s) in chosen)
        return [s if s is not None and id(s) in chosen else None for s in instance.slots[: last + 1]], 0.0

    async def _execute(self, index: int, instance: _Instance, picked: list[_Sequence | None]) -> None:
        taken: list[tuple[_Sequence, _Pending] | None] = []
        for sequence in picked:
            taken.append(None if sequence is None else (sequence, sequence.queue.popleft()))
        try:
            await self._run_batch(index, taken)
        finally:
            instance.busy = False
            for item in taken:
                if item is not None and item[0].ended and not item[0].queue:
                    self._release(item[0])
            self._wake.set()

    async def _run_batch(self, index: int, taken: list[tuple[_Sequence, _Pending] | None]) -> None:
        settings = self.settings
        first = next(item[1] for item in taken if item is not None)
        started = time.perf_counter_ns()
        rows: list[Row] = []
        for item in taken:
            if item is None:
                arrays = {name: np.zeros_like(array) for name, array in first.arrays.items()}
                rows.append(Row(self._add_inputs(arrays, None, None), 0, 0))
                continue
            sequence, pending = item
            if pending.sequence.start or sequence.state is None:
                sequence.state = {s.input_name: s.initial for s in settings.states}
            arrays = self._add_inputs(dict(pending.arrays), pending.sequence, sequence.state)
            rows.append(Row(arrays, pending.sequence.value, pending.sequence.flags))
        live = [item for item in taken if item is not None]
        merged = _merge([row.inputs for row in rows], settings.batching)
        latest = max((p.deadline.at for _, p in live if p.deadline.at is not None), default=None)
        deadline = Deadline(
            latest if len(live) == sum(1 for _, p in live if p.deadline.at is not None) else None
        )
        try:
            results, compute_ns = await self._run(index, merged, rows, deadline)
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
                pending.future.set_exception(
                    PipelineError(
                        f"model '{self.model}' returned no state output {', '.join(missing)} for sequence "
                        f"{pending.sequence.value}"
                    )
                )
                continue
            sequence.state = {
                s.input_name: _one(result[s.output_name], settings.batching) for s in settings.states
            }
            sequence.last = self._clock()
            pending.future.set_result((result, started - pending.enqueued, compute_ns))

    def _add_inputs(
        self,
        arrays: dict[str, np.ndarray],
        sequence: SequenceId | None,
        state: Mapping[str, np.ndarray] | None,
    ) -> dict[str, np.ndarray]:
        """A row's inputs with its control inputs and its state (`sequence` None: a padding row)."""
        lead = (1, 1) if self.settings.batching else (1,)
        for control in self.settings.controls:
            if control.kind == CONTROL.CONTROL_SEQUENCE_CORRID:
                arrays[control.name] = _corrid(control, sequence, self.model).reshape(lead)
                continue
            if sequence is None:
                on = False
            elif control.kind == CONTROL.CONTROL_SEQUENCE_START:
                on = sequence.start
            elif control.kind == CONTROL.CONTROL_SEQUENCE_END:
                on = sequence.end
            else:
                on = True
            value = control.values[1 if on else 0]
            arrays[control.name] = np.full(lead, value, DATATYPES[control.datatype])
        for spec in self.settings.states:
            current = state[spec.input_name] if state is not None else spec.initial
            arrays[spec.input_name] = current[np.newaxis] if self.settings.batching else current
        return arrays


def _corrid(control: Control, sequence: SequenceId | None, model: str) -> np.ndarray:
    value = 0 if sequence is None else sequence.value
    if control.datatype == "BYTES":
        return np.array([str(value).encode() if value else b""], dtype=object)
    if isinstance(value, str):
        raise InvalidInput(
            f"sequence id '{value}' is a string, but model '{model}' takes its CONTROL_SEQUENCE_CORRID "
            f"'{control.name}' as {control.datatype}: send a number"
        )
    dtype = DATATYPES[control.datatype]
    if value > np.iinfo(dtype).max:
        raise InvalidInput(
            f"sequence id {value} does not fit model '{model}''s CONTROL_SEQUENCE_CORRID '{control.name}' "
            f"({control.datatype})"
        )
    return np.array([value], dtype)


def _merge(rows: list[dict[str, np.ndarray]], batching: bool) -> dict[str, np.ndarray]:
    if not batching:
        return rows[0]
    if len(rows) == 1:
        return rows[0]
    return {name: np.concatenate([row[name] for row in rows]) for name in rows[0]}


def _one(array: np.ndarray, batching: bool) -> np.ndarray:
    return np.asarray(array[0]) if batching else np.asarray(array)


def split_rows(outputs: Mapping[str, np.ndarray], count: int, batching: bool) -> list[dict[str, np.ndarray]]:
    """A batch's outputs, one dict per row (the whole outputs for a model that does not batch)."""
    if not batching:
        return [dict(outputs)]
    for name, array in outputs.items():
        if array.shape[:1] != (count,):
            raise PipelineError(
                f"output '{name}' has shape {list(array.shape)}; a batch of {count} rows needs {count} first"
            )
    return [{name: array[i : i + 1] for name, array in outputs.items()} for i in range(count)]

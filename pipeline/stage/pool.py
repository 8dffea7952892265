"""The instances of one model version (Triton's `instance_group`), each on a thread of its own, and the
idle ones that a request takes an instance from, in turn.

A model that calls models (BLS) holds its instance while it waits for its calls, so a call to a model
whose every instance is held by requests waiting on calls like it could never run (a model calling itself
with more callers at once than it has instances). The pool knows which requests wait on which instances
(each request's `CallChain` names the instances waiting on it; an instance's `key` changes at each turn, so
it names the request it runs now): it serves first the requests its own instances wait on, since only they
can free an instance, and says when every instance waits on a request that waits for one (`wedged`), so
that the call closing the circle is refused instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
import types
import uuid
from collections import deque
from collections.abc import Coroutine, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from pipeline.protocol.call_chain import CallChain
from pipeline.protocol.errors import DeadlineExceeded
from pipeline.stage.api import NO_DEADLINE, Deadline
from pipeline.stage.backend import Instance, ResponseSink
from pipeline.stage.bls import BlsScope

log = logging.getLogger(__name__)

#: What a call whose deadline passed (or whose caller went away) before its batch started is answered.
NOT_STARTED_MESSAGE = "deadline exceeded (or the call was cancelled) before the batch started: it was not run"

#: A lone instance that may (`Instance.inline_when_brief`) runs a batch on the event loop while its batches
#: have lately taken less than this: handing a batch to a thread and back cost more CPU than a small batch
#: itself (about 700 µs a call on a 2-core VM, most of it the kernel waking one thread for the other), and
#: nothing could run beside a lone instance anyway. Longer batches go back to the thread, so that the loop
#: never stops answering health checks and other calls for long.
BRIEF_S = 0.02
#: The weight of a batch briefer than the running average of batch times in that average.
_RECENT_WEIGHT = 0.25
#: An instance whose coroutine batches run on the event loop (`Slot.on_loop`) and held it this long between two
#: awaits runs its later batches on its thread: the loop answers every model and health check of the service.
LONG_STEP_S = 0.05

T = TypeVar("T")


class Slot:
    """One instance and the one thread it runs on.

    `started` and `finished` are written only by the thread running the instance's batch, one batch at a time
    (one writer each, no lock)."""

    def __init__(self, instance: Instance, label: str, *, alone: bool = False) -> None:
        self.instance = instance
        self._id = uuid.uuid4().hex[:16]
        #: How many times a request took the instance (`InstancePool.take`).
        self.turn = 0
        self.executor = None if instance.inline else ThreadPoolExecutor(1, thread_name_prefix=label)
        #: Whether brief batches run on the event loop (see `BRIEF_S`); the first batch always goes to the
        #: thread, and is timed.
        # NOTE: an instance of a backend written before the attribute existed stays on its thread.
        self.brief_inline = alone and bool(getattr(instance, "inline_when_brief", False))
        #: Running average of the batch times, in seconds (None before the first batch).
        self.recent_s: float | None = None
        self.started = 0
        self.finished = 0
        #: Whether its batches are coroutines run on the event loop (`Instance.run_async`), and the last one.
        self.on_loop = bool(getattr(instance, "on_loop", False))
        self._running: asyncio.Task[tuple[dict[str, np.ndarray], int, int, int, int]] | None = None

    @property
    def key(self) -> str:
        """Names the instance's request now in the chains of the calls its model makes
        (`pipeline.protocol.call_chain`): unique across processes, and new at each turn, so that a call
        made by an earlier request of the instance, and left behind, is not taken for one it waits on."""
        return f"{self._id}.{self.turn}"

    def run(
        self, arrays: dict[str, np.ndarray], deadline: Deadline = NO_DEADLINE, scope: BlsScope | None = None
    ) -> tuple[dict[str, np.ndarray], int, int, int, int]:
        """Run one batch and time it: the result, its perf-counter start and end, and its wall-clock ones.
        A batch whose deadline has passed by the time the instance's thread takes it up is not started.
        `scope`: where the calls its model makes go (`pipeline.stage.bls`)."""
        if deadline.expired():
            raise DeadlineExceeded(NOT_STARTED_MESSAGE)
        self.started += 1
        entered = None if scope is None else scope.enter()
        wall_start, begun = time.time_ns(), time.perf_counter_ns()
        try:
            result = self.instance.run(arrays, deadline)
        finally:
            self.finished += 1
            if entered is not None:
                BlsScope.leave(entered)
        return result, begun, time.perf_counter_ns(), wall_start, time.time_ns()

    def run_decoupled(
        self,
        arrays: dict[str, np.ndarray],
        deadline: Deadline,
        sink: ResponseSink,
        scope: BlsScope | None = None,
    ) -> None:
        """Run one request of a decoupled instance (its responses go to `sink`), counted as `run` counts."""
        if deadline.expired():
            raise DeadlineExceeded(NOT_STARTED_MESSAGE)
        self.started += 1
        entered = None if scope is None else scope.enter()
        try:
            self.instance.run_decoupled(arrays, deadline, sink)  # type: ignore[attr-defined]
        finally:
            self.finished += 1
            if entered is not None:
                BlsScope.leave(entered)

    async def execute(
        self, arrays: dict[str, np.ndarray], deadline: Deadline, scope: BlsScope | None = None
    ) -> tuple[dict[str, np.ndarray], int, int, int, int]:
        """`run` one batch on the instance's thread, or on the event loop where it is inline or lately brief,
        or where the instance's batches are coroutines (`run_async`)."""
        if self.on_loop:
            await self._finished()
            running = self._running = asyncio.get_running_loop().create_task(
                self._run_async(arrays, deadline, scope)
            )
            # NOTE: a caller that goes away leaves the batch running, as a thread would; the model sees its
            # request cancelled (`is_cancelled()`, its calls answered CANCELLED), never an exception.
            return await asyncio.shield(running)
        recent = self.recent_s
        if self.executor is None or (self.brief_inline and recent is not None and recent < BRIEF_S):
            outcome = self.run(arrays, deadline, scope)
        else:
            loop = asyncio.get_running_loop()
            outcome = await loop.run_in_executor(self.executor, self.run, arrays, deadline, scope)
        if self.brief_inline:
            took = (outcome[2] - outcome[1]) / 1e9
            # A long batch counts at once (the next goes to the thread); brief ones bring the average down
            # slowly.
            self.recent_s = (
                took if recent is None or took > recent else recent + _RECENT_WEIGHT * (took - recent)
            )
        return outcome

    async def _run_async(
        self, arrays: dict[str, np.ndarray], deadline: Deadline, scope: BlsScope | None
    ) -> tuple[dict[str, np.ndarray], int, int, int, int]:
        """`run` for a coroutine batch, in a task of its own (whose context holds `scope`)."""
        if deadline.expired():
            raise DeadlineExceeded(NOT_STARTED_MESSAGE)
        self.started += 1
        if scope is not None:
            scope.enter()
        wall_start, begun = time.time_ns(), time.perf_counter_ns()
        held = [0.0]
        try:
            result = await _timed(self.instance.run_async(arrays, deadline), held)  # type: ignore[attr-defined]
        finally:
            self.finished += 1
            if held[0] > LONG_STEP_S and self.on_loop:
                self.on_loop = False
                log.warning(
                    "%s held the service's event loop for %.0f ms without awaiting: its later batches run on "
                    "its own thread",
                    self.instance.reason,
                    held[0] * 1e3,
                )
        return result, begun, time.perf_counter_ns(), wall_start, time.time_ns()

    async def _finished(self) -> None:
        """Wait until the instance's last coroutine batch has finished: it runs one at a time, as on a thread."""
        running = self._running
        if running is not None and not running.done():
            await asyncio.wait((running,))

    async def call(self, method: Any, *args: Any) -> Any:
        """Call one of the instance's blocking methods on its thread (or inline)."""
        await self._finished()
        if self.executor is None:
            return method(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, method, *args)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False)


@types.coroutine
def _timed(coroutine: Coroutine[Any, Any, T], held: list[float]) -> Generator[Any, Any, T]:
    """Await `coroutine`, keeping in `held[0]` the longest it ran (seconds) between two of its awaits."""
    value: Any = None
    error: BaseException | None = None
    while True:
        started = time.perf_counter()
        try:
            step = coroutine.send(value) if error is None else coroutine.throw(error)
        except StopIteration as stop:
            return stop.value
        finally:
            held[0] = max(held[0], time.perf_counter() - started)
        try:
            value, error = (yield step), None
        except BaseException as exc:  # thrown into the awaiting task: the coroutine gets it
            value, error = None, exc


class _Waiter:
    """A request waiting for an instance: the chain of calls it belongs to, where its instance goes, and
    whether it is still in line."""

    __slots__ = ("chain", "future", "queued")

    def __init__(self, chain: CallChain | None, future: asyncio.Future[Slot]) -> None:
        self.chain = chain
        self.future = future
        self.queued = True


@dataclass(eq=False)
class InstancePool:
    """The instances of a version, the idle ones, and the requests waiting for one (see the module
    docstring)."""

    slots: list[Slot]
    unloaded: bool = False
    _idle: deque[Slot] = field(init=False, repr=False)
    _waiting: deque[_Waiter] = field(init=False, repr=False)
    #: How many of the waiters belong to a chain of calls (the others come from clients).
    _chained: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._idle = deque(self.slots)
        self._waiting = deque()

    async def take(self, chain: CallChain | None = None, timeout: float | None = None) -> Slot:
        """An idle instance, once it is this request's turn (`chain`: the chain of calls it belongs to, if a
        model made it); a request that the pool's own instances wait on goes ahead of the others. Raises
        `DeadlineExceeded` where none came within `timeout` seconds: the request was not started."""
        if self._idle and not self._waiting:
            return self._turn(self._idle.popleft())
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(chain, future)
        self._waiting.append(waiter)
        self._chained += chain is not None
        taken = False
        try:
            async with asyncio.timeout(timeout):
                slot = await future
            taken = True
            return slot
        except TimeoutError:
            raise DeadlineExceeded(NOT_STARTED_MESSAGE) from None
        finally:
            if waiter.queued:
                self._leave(waiter)
            elif not taken and not future.cancelled():
                self.give(future.result())  # given to it as it went away: the next one's

    def give(self, slot: Slot) -> None:
        """An instance is idle again: to the first request waiting that the pool's own instances wait on, else
        to the first one waiting."""
        while self._waiting:
            waiter = self._next() if self._chained else self._waiting[0]
            self._leave(waiter)
            if not waiter.future.done():  # else cancelled, its task not yet told
                waiter.future.set_result(self._turn(slot))
                return
        self._idle.append(slot)

    def _leave(self, waiter: _Waiter) -> None:
        self._waiting.remove(waiter)
        waiter.queued = False
        self._chained -= waiter.chain is not None

    def _next(self) -> _Waiter:
        keys = {slot.key for slot in self.slots}
        for waiter in self._waiting:
            if waiter.chain is not None and not keys.isdisjoint(waiter.chain.waiting):
                return waiter
        return self._waiting[0]

    @staticmethod
    def _turn(slot: Slot) -> Slot:
        slot.turn += 1
        return slot

    def wedged(self, chain: CallChain) -> bool:
        """Whether a request of `chain` could never get an instance: none is idle, and each waits (through
        the calls its request made) on this request or on a request waiting for an instance here. Only a
        request that gives up could then free one."""
        if self._idle:
            return False
        keys = {slot.key for slot in self.slots}
        waited = keys & chain.waiting
        for waiter in self._waiting:
            if waiter.chain is not None and not waiter.future.done():
                waited |= keys & waiter.chain.waiting
        return waited == keys

    async def load(self) -> None:
        """Load the first instance alone (it may build and cache an engine the others reuse), then the rest
        together; on failure unload what loaded."""
        loaded: list[Slot] = []
        try:
            for group in (self.slots[:1], self.slots[1:]):
                await asyncio.gather(*(s.call(s.instance.load) for s in group))
                loaded += group
        except BaseException:
            await asyncio.gather(*(s.call(s.instance.unload) for s in loaded), return_exceptions=True)
            for slot in self.slots:
                slot.close()
            raise

    async def unload(self) -> None:
        """Unload every instance (once, however many versions share the pool)."""
        if self.unloaded:
            return
        self.unloaded = True
        for slot in self.slots:
            try:
                await slot.call(slot.instance.unload)
            except Exception:
                log.exception("unloading an instance failed")
            slot.close()

"""The instances of one model version (Triton's `instance_group`), each on a thread of its own, and the
queue of the idle ones that a request takes an instance from."""

from __future__ import annotations

import asyncio
import logging
import time
import types
import uuid
from collections.abc import Coroutine, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from pipeline.protocol.errors import DeadlineExceeded
from pipeline.stage.api import NO_DEADLINE, Deadline
from pipeline.stage.backend import Instance, ResponseSink
from pipeline.stage.bls import CallScope

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
        #: Names the instance in the chains of the calls its model makes (`pipeline.protocol.call_chain`).
        self.key = uuid.uuid4().hex[:16]
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
    def busy(self) -> bool:
        """Whether the instance is running a batch."""
        return self.started != self.finished

    def run(
        self, arrays: dict[str, np.ndarray], deadline: Deadline = NO_DEADLINE, scope: CallScope | None = None
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
                CallScope.leave(entered)
        return result, begun, time.perf_counter_ns(), wall_start, time.time_ns()

    def run_decoupled(
        self,
        arrays: dict[str, np.ndarray],
        deadline: Deadline,
        sink: ResponseSink,
        scope: CallScope | None = None,
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
                CallScope.leave(entered)

    async def execute(
        self, arrays: dict[str, np.ndarray], deadline: Deadline, scope: CallScope | None = None
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
        self, arrays: dict[str, np.ndarray], deadline: Deadline, scope: CallScope | None
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


@dataclass(eq=False)
class InstancePool:
    """The instances of a version, and a queue of the idle ones."""

    slots: list[Slot]
    idle: asyncio.Queue[Slot] = field(default_factory=asyncio.Queue)
    unloaded: bool = False

    def __post_init__(self) -> None:
        for slot in self.slots:
            self.idle.put_nowait(slot)

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

"""How a server process stops within a bound, and why it never outlives the process that started it.

Stopping (`pipeline.runtime.lifecycle.ServerLifecycle.run`): SIGTERM reports NOT_SERVING and keeps serving for the drain
delay, then new calls are refused and those in flight get the grace period. Whatever is still held then (a
request waiting on a model instance that never returns, on a sequence's slot, on a BLS call, on a stage) is
answered UNAVAILABLE (`HeldRequests.abandon`, `Stopped`), and those answers get `ABANDON_S` to go out before
every call, stream and connection is closed. The process exits at the latest `EXIT_MARGIN_S` after the grace
period, and `CLOSE_S` after a drain that ended sooner, whatever its threads do: the thread of a model instance
that never returns cannot be joined, so a watchdog ends the process (`exit_within`).

A service that a launcher started (`pipeline run`'s services, a router's workers) dies with it, even when
the launcher is killed: the launcher names itself in the child's environment (`child_environment`), and the
child asks Linux to SIGKILL it when its parent ends (`die_with_parent`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, MutableMapping
from types import TracebackType

from pipeline.protocol.errors import Stopped, Unavailable

log = logging.getLogger(__name__)

#: How long the requests answered UNAVAILABLE at the end of the grace period have for their answers to go
#: out before every call, stream and connection is closed.
ABANDON_S = 1.0
#: How long after its grace period a stopping server process exits at the latest: `ABANDON_S`, then the
#: rest to unload its models and close what it opened (`CLOSE_S`, from the end of the drain).
EXIT_MARGIN_S = 5.0
CLOSE_S = EXIT_MARGIN_S - ABANDON_S
#: The exit code of a process that the watchdog ended (something in it did not stop in time).
FORCED_EXIT_CODE = 1

#: The pid of the launcher that started this process, set by the launcher in the child's environment.
PARENT_PID_ENV = "PIPELINE_PARENT_PID"
#: prctl(2)'s option that asks for a signal when the parent ends.
PR_SET_PDEATHSIG = 1

STOPPED_MESSAGE = "the server stopped before the request was done (its grace period was over)"


def exit_deadline(drain_delay: float, grace: float) -> float:
    """Seconds from SIGTERM by which a server process has exited: the drain delay, the grace period and
    `EXIT_MARGIN_S`."""
    return drain_delay + grace + EXIT_MARGIN_S


class HeldRequests:
    """The requests a server is serving, each in its task, so that those still held when its grace period is
    over are answered UNAVAILABLE instead of waiting for what may never come.

    A request is held for the time of a `with held:` block, in its task; once `abandon` is called the block
    raises `Stopped` where the task was waiting, and a block entered later raises `Unavailable` (not
    started: a router sends it to another replica)."""

    __slots__ = ("_tasks", "abandoned")

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[object]] = set()
        self.abandoned = False

    def __enter__(self) -> None:
        if self.abandoned:
            raise Unavailable("the server is stopping")
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.discard(task)
        if kind is not None and issubclass(kind, asyncio.CancelledError) and self.abandoned:
            task.uncancel()  # this cancellation was `abandon`'s, and ends here as an answer
            raise Stopped(STOPPED_MESSAGE) from None

    def __len__(self) -> int:
        return len(self._tasks)

    def abandon(self) -> int:
        """Answer every request still held UNAVAILABLE (`Stopped`) and refuse later ones; returns how many
        were held."""
        self.abandoned = True
        held = list(self._tasks)
        for task in held:
            task.cancel()
        return len(held)


def exit_within(seconds: float, what: str) -> threading.Timer:
    """End the process `seconds` from now (`FORCED_EXIT_CODE`) unless it has exited by then, or the timer is
    cancelled: a stopping server whose threads (a model that never returns) or closing outlive its bound.
    `what`: the stage of the stop that took too long, for the log."""
    timer = threading.Timer(seconds, _exit_now, args=(seconds, what))
    timer.name = "exit watchdog"
    timer.daemon = True
    timer.start()
    return timer


def _exit_now(seconds: float, what: str) -> None:
    main = threading.main_thread()
    running = [t.name for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]
    log.error(
        "%s took more than %.1fs: exiting without waiting for %s",
        what,
        seconds,
        f"its threads {', '.join(running)}" if running else "what it was closing",
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(FORCED_EXIT_CODE)


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a process this one starts and that must not outlive it (`die_with_parent`)."""
    return {**environ, PARENT_PID_ENV: str(os.getpid())}


def die_with_parent(environ: MutableMapping[str, str] = os.environ) -> None:
    """Where a launcher started this process (`child_environment`), have Linux SIGKILL it when the launcher
    ends, however it ends; exit at once (SystemExit) where the launcher has ended already. The variable is
    taken out of `environ`: this process's own children name it as theirs."""
    parent = environ.pop(PARENT_PID_ENV, None)
    if parent is None:
        return
    if sys.platform.startswith("linux"):
        # NOTE: Linux sends the signal when the *thread* that started this process ends: a launcher starts
        # its services from its main thread.
        libc = ctypes.CDLL(None, use_errno=True)
        zero = ctypes.c_ulong(0)
        if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), zero, zero, zero) != 0:
            log.warning("cannot ask to end with the launcher: %s", os.strerror(ctypes.get_errno()))
    # Asked after the request, so that a launcher that ended before it is seen: this process has another
    # parent then.
    if os.getppid() != int(parent):
        log.error("the launcher that started this process (pid %s) has ended: exiting", parent)
        raise SystemExit(1)

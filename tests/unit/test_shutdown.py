"""What bounds a server's stop: the requests still held at the end of the grace period are answered, and a
launched process names its launcher."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import grpc
import pytest

from pipeline.protocol.errors import Stopped, Unavailable
from pipeline.runtime.shutdown import PARENT_PID_ENV, HeldRequests, child_environment


async def test_abandon_answers_each_held_request_stopped_and_refuses_later_ones():
    held = HeldRequests()
    never = asyncio.Event()
    entered = asyncio.Event()

    async def request() -> None:
        with held:
            entered.set()
            await never.wait()

    tasks = [asyncio.create_task(request()) for _ in range(3)]
    while len(held) < 3:
        await entered.wait()
        entered.clear()
    assert held.abandon() == 3
    for task in tasks:
        with pytest.raises(Stopped) as info:
            await task
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "grace period" in info.value.message
        assert not task.cancelled() and task.cancelling() == 0  # the cancellation ended as an answer
    assert len(held) == 0
    with pytest.raises(Unavailable, match="stopping"), held:
        pass


async def test_a_cancellation_before_abandon_stays_a_cancellation():
    held = HeldRequests()
    entered = asyncio.Event()

    async def request() -> None:
        with held:
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(request())
    await entered.wait()
    task.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(held) == 0 and held.abandon() == 0


#: A process that asks to end with its launcher, then says which signal its parent's end sends it.
CHILD = """
import ctypes
from pipeline.runtime.shutdown import die_with_parent

die_with_parent()
signal = ctypes.c_int(0)
ctypes.CDLL(None).prctl(2, ctypes.byref(signal), 0, 0, 0)  # PR_GET_PDEATHSIG
print(signal.value)
"""


def _child(environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD], env=environ, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_a_launched_process_is_killed_when_its_launcher_ends():
    environ = child_environment(os.environ)
    assert environ[PARENT_PID_ENV] == str(os.getpid())
    done = _child(environ)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(int(signal.SIGKILL))]


def test_a_process_whose_launcher_has_ended_exits():
    # Its parent is this process, not the one named: as for a launcher that ended before the child asked.
    done = _child({**os.environ, PARENT_PID_ENV: str(os.getppid())})
    assert done.returncode == 1 and "has ended" in done.stderr
    assert done.stdout == ""


def test_a_process_no_launcher_started_keeps_its_parent_death_signal_off():
    done = _child({k: v for k, v in os.environ.items() if k != PARENT_PID_ENV})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"]

"""Where an instance's batches run: a lone model-file instance runs brief batches on the event loop once its
first batch (on its own thread) showed them brief, goes back to its thread when batches grow long, and an
instance among several, or one that may wait on its request, always runs on its thread."""

from __future__ import annotations

import threading
import time

import numpy as np

from pipeline.stage.api import NO_DEADLINE
from pipeline.stage.pool import BRIEF_S, Slot


class Recorder:
    """An instance that records the thread each batch ran on, each taking `seconds`."""

    device, reason, inline = "cpu", "test", False

    def __init__(self, inline_when_brief: bool, seconds: float = 0.0) -> None:
        self.inline_when_brief = inline_when_brief
        self.seconds = seconds
        self.threads: list[str] = []

    def load(self) -> None:
        pass

    def run(self, inputs, deadline=NO_DEADLINE):
        self.threads.append(threading.current_thread().name)
        if self.seconds:
            time.sleep(self.seconds)
        return {"Y": inputs["X"]}

    def unload(self) -> None:
        pass


async def _run(slot: Slot, batches: int, recorder: Recorder, seconds: list[float] | None = None) -> None:
    for i in range(batches):
        if seconds is not None:
            recorder.seconds = seconds[i]
        result, *_ = await slot.execute({"X": np.arange(3)}, NO_DEADLINE)
        assert result["Y"].tolist() == [0, 1, 2]


async def test_a_lone_instance_runs_brief_batches_on_the_event_loop_after_the_first() -> None:
    recorder = Recorder(inline_when_brief=True)
    slot = Slot(recorder, "model-m-1-0", alone=True)
    await _run(slot, 3, recorder)
    loop_thread = threading.current_thread().name
    assert recorder.threads[0].startswith("model-m-1-0")  # the first is timed on the instance's thread
    assert recorder.threads[1:] == [loop_thread, loop_thread]
    slot.close()


async def test_long_batches_go_back_to_the_instance_thread() -> None:
    recorder = Recorder(inline_when_brief=True)
    slot = Slot(recorder, "model-m-1-0", alone=True)
    long = BRIEF_S * 3
    await _run(slot, 10, recorder, seconds=[0.0, long, long, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    loop_thread = threading.current_thread().name
    # Brief, then one long batch on the loop (nothing said it would be long), then the thread until the
    # running average of batch times is brief again.
    assert recorder.threads[1] == loop_thread
    on_thread = [name.startswith("model-m-1-0") for name in recorder.threads]
    assert on_thread[2:4] == [True, True] and on_thread[-1] is False
    slot.close()


async def test_instances_among_several_or_that_may_wait_on_their_request_keep_their_thread() -> None:
    for recorder, alone in (
        (Recorder(inline_when_brief=True), False),
        (Recorder(inline_when_brief=False), True),
    ):
        slot = Slot(recorder, "model-m-1-0", alone=alone)
        await _run(slot, 3, recorder)
        assert all(name.startswith("model-m-1-0") for name in recorder.threads)
        slot.close()

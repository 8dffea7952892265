"""The dynamic batcher without sockets or sleeps: a manual clock and event gates decide every moment."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.protocol.errors import DeadlineExceeded, InvalidInput, Unavailable
from pipeline.protocol.types import BatchingConfig
from pipeline.router.scheduling.batching import DynamicBatcher, priority_index
from pipeline.router.scheduling.clock import ManualClock


class Stage:
    """An `execute` that records each batch and can hold batches until the test releases them."""

    def __init__(self, gated: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.gated = gated
        self.gates: list[asyncio.Event] = []
        self.started = asyncio.Event()

    async def __call__(self, payloads):
        self.batches.append(list(payloads))
        gate = asyncio.Event()
        self.gates.append(gate)
        self.started.set()
        if self.gated:
            await gate.wait()
        return [p * 10 if p >= 0 else InvalidInput(f"item {p} refused") for p in payloads]

    def release(self, index: int = 0) -> None:
        self.gates[index].set()


async def settle() -> None:
    """Let every ready task run (no time passes on the manual clock)."""
    for _ in range(20):
        await asyncio.sleep(0)


def make(config: BatchingConfig, stage: Stage, clock: ManualClock | None = None) -> DynamicBatcher:
    batcher = DynamicBatcher("stage 'model' (m)", stage, config, clock=clock or ManualClock())
    batcher.start()
    return batcher


async def submit_all(batcher, payloads, **kw):
    tasks = [asyncio.ensure_future(batcher.submit(p, **kw)) for p in payloads]
    await settle()
    return tasks


async def test_a_full_batch_goes_at_once():
    stage = Stage()
    batcher = make(
        BatchingConfig(max_batch_size=4, max_queue_delay_microseconds=10**6, idle_dispatch=False), stage
    )
    tasks = await submit_all(batcher, [1, 2, 3, 4])
    assert stage.batches == [[1, 2, 3, 4]]
    assert [t.result() for t in tasks] == [10, 20, 30, 40]
    await batcher.aclose()


async def test_a_partial_batch_waits_exactly_the_delay():
    clock = ManualClock()
    stage = Stage()
    config = BatchingConfig(max_batch_size=8, max_queue_delay_microseconds=1000, idle_dispatch=False)
    batcher = make(config, stage, clock)
    tasks = await submit_all(batcher, [1, 2])
    clock.advance(0.0009)
    await settle()
    assert stage.batches == []
    clock.advance(0.0001)
    await settle()
    assert stage.batches == [[1, 2]]
    assert [t.result() for t in tasks] == [10, 20]
    await batcher.aclose()


async def test_preferred_batch_size_goes_without_waiting():
    clock = ManualClock()
    stage = Stage()
    config = BatchingConfig(
        max_batch_size=8, preferred_batch_size=(2,), max_queue_delay_microseconds=1000, idle_dispatch=False
    )
    batcher = make(config, stage, clock)
    tasks = await submit_all(batcher, [1, 2, 3])
    assert stage.batches[0] == [1, 2]
    assert not tasks[2].done()
    clock.advance(0.001)
    await settle()
    assert stage.batches == [[1, 2], [3]]
    await batcher.aclose()


async def test_idle_dispatch_sends_a_lone_request_at_once_and_batches_fill_under_load():
    stage = Stage(gated=True)
    config = BatchingConfig(max_batch_size=8, max_queue_delay_microseconds=10**6, max_inflight_batches=1)
    batcher = make(config, stage)
    first = await submit_all(batcher, [1])
    assert stage.batches == [[1]], "a lone request must not wait out the delay"
    rest = await submit_all(batcher, [2, 3, 4, 5])
    assert stage.batches == [[1]], "the only slot is busy: the others queue"
    stage.release(0)
    await settle()
    assert stage.batches == [[1], [2, 3, 4, 5]]
    stage.release(1)
    await settle()
    assert [t.result() for t in first + rest] == [10, 20, 30, 40, 50]
    await batcher.aclose()


async def test_while_a_batch_runs_a_free_slot_waits_for_the_preferred_size_or_the_delay():
    """With two replicas, a free slot does not send a batch of one while the other replica is busy: it
    waits for the largest preferred size, or until the oldest request has waited the delay."""
    clock = ManualClock()
    stage = Stage(gated=True)
    config = BatchingConfig(
        max_batch_size=8,
        max_queue_delay_microseconds=30_000,
        preferred_batch_size=(3,),
        max_inflight_batches=2,
    )
    batcher = make(config, stage, clock)
    tasks = await submit_all(batcher, [1])
    assert stage.batches == [[1]], "the stage was idle: a lone request goes at once"
    tasks += await submit_all(batcher, [2, 3])
    assert stage.batches == [[1]], "a slot is free, but a batch runs: two of three preferred wait"
    tasks += await submit_all(batcher, [4, 5])
    assert stage.batches == [[1], [2, 3, 4]], "the preferred size is reached: it goes at once"
    clock.advance(0.029)
    await settle()
    assert stage.batches == [[1], [2, 3, 4]], "both slots are busy"
    stage.release(0)
    await settle()
    assert stage.batches == [[1], [2, 3, 4]], "a slot is free while a batch runs: 5 waits for more"
    clock.advance(0.001)
    await settle()
    assert stage.batches[2:] == [[5]], "its delay passed: it goes"
    stage.release(1)
    stage.release(2)
    await settle()
    assert [t.result() for t in tasks] == [10, 20, 30, 40, 50]
    await batcher.aclose()


async def test_a_partial_batch_goes_after_its_delay_while_another_batch_runs():
    clock = ManualClock()
    stage = Stage(gated=True)
    config = BatchingConfig(
        max_batch_size=8,
        max_queue_delay_microseconds=30_000,
        preferred_batch_size=(4,),
        max_inflight_batches=2,
    )
    batcher = make(config, stage, clock)
    tasks = await submit_all(batcher, [1])
    tasks += await submit_all(batcher, [2, 3])
    clock.advance(0.029)
    await settle()
    assert stage.batches == [[1]], "a batch runs and the delay has not passed: 2 and 3 wait"
    clock.advance(0.001)
    await settle()
    assert stage.batches == [[1], [2, 3]], "the delay passed: the partial batch goes"
    stage.release(0)
    stage.release(1)
    await settle()
    assert [t.result() for t in tasks] == [10, 20, 30]
    await batcher.aclose()


async def test_an_idle_stage_takes_everything_queued_past_the_preferred_size():
    stage = Stage(gated=True)
    config = BatchingConfig(max_batch_size=8, max_queue_delay_microseconds=10**6, preferred_batch_size=(2,))
    batcher = make(config, stage)
    tasks = await submit_all(batcher, [1, 2, 3, 4, 5, 6])
    assert stage.batches == [[1]]
    stage.release(0)
    await settle()
    assert stage.batches[1:] == [[2, 3, 4, 5, 6]], "the stage fell idle: all five go, not the preferred two"
    stage.release(1)
    await settle()
    assert [t.result() for t in tasks] == [10, 20, 30, 40, 50, 60]
    await batcher.aclose()


async def test_batches_in_flight_follow_the_ready_replicas():
    stage = Stage(gated=True)
    replicas = [1]
    config = BatchingConfig(max_batch_size=2, max_queue_delay_microseconds=10**6, max_inflight_batches=1)
    batcher = DynamicBatcher(
        "stage 'model' (m)", stage, config, clock=ManualClock(), replicas=lambda: replicas[0]
    )
    batcher.start()
    tasks = await submit_all(batcher, [1, 2, 3, 4, 5])
    assert stage.batches == [[1]], "one replica ready: one batch in flight"
    replicas[0] = 2
    batcher.replicas_changed()
    await settle()
    assert stage.batches == [[1], [2, 3]], "a second replica: a second batch at once"
    assert batcher.max_inflight == 2
    replicas[0] = 0  # none ready: the batcher still sends one batch (the stage client answers for it)
    stage.release(0)
    stage.release(1)
    await settle()
    assert stage.batches == [[1], [2, 3], [4, 5]]
    stage.release(2)
    await settle()
    assert [t.result() for t in tasks] == [10, 20, 30, 40, 50]
    await batcher.aclose()


async def test_requests_with_several_items_are_never_split():
    stage = Stage()
    config = BatchingConfig(max_batch_size=5, max_queue_delay_microseconds=10**6, idle_dispatch=False)
    batcher = make(config, stage)
    tasks = [asyncio.ensure_future(batcher.submit(p, size=s)) for p, s in ((1, 3), (2, 3), (3, 2))]
    await settle()
    # 3 + 3 > 5: the first batch takes requests 1 and 3 (3 + 2), request 2 waits for the next
    assert stage.batches[0] == [1, 3]
    with pytest.raises(InvalidInput, match="batch size 6 exceeds max_batch_size 5"):
        await batcher.submit(9, size=6)
    await batcher.aclose()
    assert tasks[0].result() == 10


async def test_deadlines_drop_queued_requests_before_the_stage_sees_them():
    clock = ManualClock()
    stage = Stage()
    config = BatchingConfig(max_batch_size=8, max_queue_delay_microseconds=10**6, idle_dispatch=False)
    batcher = make(config, stage, clock)
    doomed = asyncio.ensure_future(batcher.submit(1, deadline=clock.now() + 0.1))
    kept = asyncio.ensure_future(batcher.submit(2))
    await settle()
    clock.advance(0.1)
    await settle()
    with pytest.raises(DeadlineExceeded, match="deadline passed while it was queued"):
        doomed.result()
    clock.advance(1.0)
    await settle()
    assert stage.batches == [[2]] and kept.result() == 20
    assert batcher.counters.dropped_deadline == 1
    await batcher.aclose()


async def test_timeout_parameter_and_default_timeout():
    clock = ManualClock()
    config = BatchingConfig(default_timeout_microseconds=5000, allow_timeout_override=True)
    batcher = DynamicBatcher("b", Stage(), config, clock=clock)
    assert batcher.deadline_of(None, None) == pytest.approx(clock.now() + 0.005)
    assert batcher.deadline_of(None, 1000) == pytest.approx(clock.now() + 0.001)
    assert batcher.deadline_of(clock.now() + 0.0005, 1000) == pytest.approx(clock.now() + 0.0005)
    strict = DynamicBatcher("b", Stage(), BatchingConfig(allow_timeout_override=False), clock=clock)
    assert strict.deadline_of(None, 1000) is None


async def test_cancelled_requests_are_dropped():
    clock = ManualClock()
    stage = Stage()
    config = BatchingConfig(max_batch_size=8, max_queue_delay_microseconds=1000, idle_dispatch=False)
    batcher = make(config, stage, clock)
    gone = asyncio.ensure_future(batcher.submit(1))
    stays = asyncio.ensure_future(batcher.submit(2))
    await settle()
    gone.cancel()
    clock.advance(0.001)
    await settle()
    assert stage.batches == [[2]] and stays.result() == 20
    await batcher.aclose()


async def test_a_batch_in_flight_is_cancelled_once_none_of_its_callers_waits():
    stage = Stage(gated=True)
    config = BatchingConfig(
        max_batch_size=2, max_queue_delay_microseconds=10**6, idle_dispatch=False, max_inflight_batches=2
    )
    batcher = make(config, stage)
    first = await submit_all(batcher, [1, 2])  # one batch, held by the stage
    second = await submit_all(batcher, [3, 4])
    assert stage.batches == [[1, 2], [3, 4]]
    first[0].cancel()
    await settle()
    assert not stage.gates[0].is_set() and batcher.inflight_batches == 2  # its other caller still waits
    first[1].cancel()
    second[0].cancel()
    await settle()
    assert batcher.inflight_batches == 1  # the first batch's execution was cancelled, the second's was not
    stage.release(1)
    await settle()
    assert second[1].result() == 40
    await batcher.aclose()


async def test_a_full_queue_answers_unavailable_at_once_naming_the_stage():
    stage = Stage(gated=True)
    config = BatchingConfig(max_batch_size=1, max_queue_size=2, max_inflight_batches=1)
    batcher = make(config, stage)
    tasks = await submit_all(batcher, [1])  # in flight
    tasks += await submit_all(batcher, [2, 3])  # queued
    with pytest.raises(Unavailable, match=r"stage 'model' \(m\) is saturated: 2 requests queued"):
        await batcher.submit(4)
    assert batcher.counters.rejected_full == 1
    for i in range(3):
        stage.release(i)
        await settle()
    assert [t.result() for t in tasks] == [10, 20, 30]
    await batcher.aclose()


async def test_priorities_go_first():
    stage = Stage(gated=True)
    config = BatchingConfig(
        max_batch_size=2, priority_levels=2, default_priority_level=2, max_inflight_batches=1
    )
    batcher = make(config, stage)
    await submit_all(batcher, [0])  # occupies the slot
    low = await submit_all(batcher, [1, 2], priority=priority_index(batcher.config, None))
    high = await submit_all(batcher, [3], priority=priority_index(batcher.config, 1))
    stage.release(0)
    await settle()
    assert stage.batches[1] == [3, 1]
    stage.release(1)
    await settle()
    stage.release(2)
    await settle()
    assert [t.result() for t in high + low] == [30, 10, 20]
    # As Triton takes a request's priority: none, 0, or one outside 1..priority_levels is the default level.
    assert [priority_index(batcher.config, p) for p in (None, 0, 1, 2, 3, 9, -1)] == [1, 1, 0, 1, 1, 1, 1]
    await batcher.aclose()
    one_level = make(BatchingConfig(max_batch_size=2), Stage())
    assert priority_index(one_level.config, 1) == 0
    await one_level.aclose()


async def test_preserve_ordering_holds_a_later_batch_until_the_earlier_completes():
    stage = Stage(gated=True)
    config = BatchingConfig(max_batch_size=1, preserve_ordering=True, max_inflight_batches=2)
    batcher = make(config, stage)
    first, second = await submit_all(batcher, [1, 2])
    assert stage.batches == [[1], [2]]
    stage.release(1)  # the later batch finishes first...
    await settle()
    assert not second.done(), "...but its response waits for the earlier request"
    stage.release(0)
    await settle()
    assert first.result() == 10 and second.result() == 20


async def test_one_failing_item_fails_only_its_own_request():
    stage = Stage()
    config = BatchingConfig(max_batch_size=3, max_queue_delay_microseconds=10**6, idle_dispatch=False)
    batcher = make(config, stage)
    tasks = await submit_all(batcher, [1, -2, 3])
    assert stage.batches == [[1, -2, 3]]
    assert tasks[0].result() == 10 and tasks[2].result() == 30
    with pytest.raises(InvalidInput, match="item -2 refused"):
        tasks[1].result()
    await batcher.aclose()


async def test_a_batchs_statistics_count_each_request_as_it_fared():
    clock = ManualClock()
    stage = Stage()
    config = BatchingConfig(max_batch_size=8, max_queue_delay_microseconds=1000, idle_dispatch=False)
    batcher = make(config, stage, clock)
    tasks = [asyncio.ensure_future(batcher.submit(1, size=2))]
    await settle()
    clock.advance(0.0004)
    tasks.append(asyncio.ensure_future(batcher.submit(-2)))
    await settle()
    clock.advance(0.0004)
    tasks.append(asyncio.ensure_future(batcher.submit(3)))
    await settle()
    clock.advance(0.0002)
    await settle()
    assert stage.batches == [[1, -2, 3]]
    assert [tasks[0].result(), tasks[2].result()] == [10, 30]
    assert isinstance(tasks[1].exception(), InvalidInput)
    stats = batcher.stats
    assert (stats.inference_count, stats.execution_count) == (3, 1)  # the successes' items; one execution
    # Each success counts its own wait (1 ms and 0.2 ms) and the execution it rode in; the failure its own.
    assert (stats.success.count, stats.queue.count, stats.fail.count) == (2, 2, 1)
    assert abs(stats.queue.ns - 1_200_000) <= 2 and abs(stats.success.ns - 1_200_000) <= 2
    assert abs(stats.fail.ns - 600_000) <= 1
    (execution,) = stats.batches.values()
    assert (stats.compute_infer.count, stats.compute_infer.ns) == (2, 2 * execution.ns)
    assert (stats.compute_input.count, stats.compute_output.count) == (2, 2)
    await batcher.aclose()


async def test_requests_with_different_keys_never_share_a_batch():
    stage = Stage()
    config = BatchingConfig(max_batch_size=8, max_queue_delay_microseconds=10**6, idle_dispatch=False)
    clock = ManualClock()
    batcher = make(config, stage, clock)
    tasks = [
        asyncio.ensure_future(batcher.submit(payload, key=key))
        for payload, key in ((1, "a"), (2, "b"), (3, "a"), (4, "b"))
    ]
    await settle()
    clock.advance(1.0)
    await settle()
    assert sorted(stage.batches) == [[1, 3], [2, 4]]
    assert [t.result() for t in tasks] == [10, 20, 30, 40]
    await batcher.aclose()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 50), st.integers(1, 4), st.sampled_from("xy"), st.integers(0, 3)),
        min_size=1,
        max_size=40,
    ),
    max_batch_size=st.integers(4, 9),
    inflight=st.integers(1, 3),
    idle=st.booleans(),
)
def test_batched_results_equal_unbatched_results(arrivals, max_batch_size, inflight, idle):
    """Whatever the arrival pattern, every request gets exactly what it would get alone."""

    async def scenario():
        clock = ManualClock()
        seen: list[list[tuple[int, int, str]]] = []

        async def execute(payloads):
            seen.append(list(payloads))
            await asyncio.sleep(0)
            return [(value * 7 + size, key) for value, size, key in payloads]

        config = BatchingConfig(
            max_batch_size=max_batch_size,
            max_queue_delay_microseconds=2000,
            max_inflight_batches=inflight,
            idle_dispatch=idle,
        )
        batcher = DynamicBatcher("b", execute, config, clock=clock)
        batcher.start()
        tasks = []
        for value, size, key, gap in arrivals:
            tasks.append(asyncio.ensure_future(batcher.submit((value, size, key), size=size, key=key)))
            clock.advance(gap / 1000)
            await settle()
        for _ in range(10):
            clock.advance(0.01)
            await settle()
        results = [t.result() for t in tasks]
        await batcher.aclose()
        return results, seen

    results, seen = asyncio.run(scenario())
    assert results == [(v * 7 + s, k) for v, s, k, _ in arrivals]
    for batch in seen:
        assert sum(size for _, size, _ in batch) <= max_batch_size
        assert len({key for _, _, key in batch}) == 1
    assert sum(len(b) for b in seen) == len(arrivals)


async def test_a_full_batch_of_one_key_does_not_wait_for_another_keys_delay():
    clock = ManualClock()
    stage = Stage()
    config = BatchingConfig(max_batch_size=2, max_queue_delay_microseconds=10**6, idle_dispatch=False)
    batcher = make(config, stage, clock)
    waiting = asyncio.ensure_future(batcher.submit(1, key="a"))
    full = [asyncio.ensure_future(batcher.submit(p, key="b")) for p in (2, 3)]
    await settle()
    assert stage.batches == [[2, 3]], "key b's batch is full: it goes while key a waits out its delay"
    assert [t.result() for t in full] == [20, 30] and not waiting.done()
    clock.advance(1.0)
    await settle()
    assert stage.batches[1] == [1] and waiting.result() == 10
    await batcher.aclose()


async def test_a_request_expires_where_it_waits_not_only_at_the_head():
    clock = ManualClock()
    stage = Stage(gated=True)
    config = BatchingConfig(max_batch_size=1, max_inflight_batches=1)
    batcher = make(config, stage, clock)
    first = await submit_all(batcher, [1])  # holds the only slot
    queued = [asyncio.ensure_future(batcher.submit(p, deadline=clock.now() + d)) for p, d in ((2, 5), (3, 1))]
    await settle()
    assert batcher.queue_depth == 2
    clock.advance(1.0)  # the second queued request expires behind the first
    await settle()
    with pytest.raises(DeadlineExceeded):
        queued[1].result()
    assert batcher.queue_depth == 1 and batcher.counters.dropped_deadline == 1
    stage.release(0)
    await settle()
    stage.release(1)
    await settle()
    assert first[0].result() == 10 and queued[0].result() == 20
    assert stage.batches == [[1], [2]], "the expired request never reached the stage"
    await batcher.aclose()


async def test_under_load_a_free_slot_waits_for_requests_already_on_their_way():
    clock = ManualClock()
    stage = Stage()
    config = BatchingConfig(max_batch_size=8, max_queue_delay_microseconds=1000, preferred_batch_size=(4,))
    batcher = make(config, stage, clock)
    for _ in range(5):
        batcher.expect()  # five requests the router holds will come here
    tasks = [asyncio.ensure_future(batcher.submit(p, expected=True)) for p in (1, 2, 3)]
    await settle()
    assert stage.batches == [], "three of the five have come: the slot waits for the preferred size"
    tasks.append(asyncio.ensure_future(batcher.submit(4, expected=True)))
    await settle()
    assert stage.batches == [[1, 2, 3, 4]], "the preferred size is reached: it goes at once"
    tasks.append(asyncio.ensure_future(batcher.submit(5, expected=True)))
    await settle()
    assert stage.batches[1:] == [[5]], "nothing more is on its way: the last one goes alone, at once"
    assert [t.result() for t in tasks] == [10, 20, 30, 40, 50]

    batcher.expect()
    batcher.expect()
    waiting = asyncio.ensure_future(batcher.submit(6, expected=True))
    await settle()
    assert len(stage.batches) == 2
    batcher.unexpect()  # the other request failed on its way: nothing to wait for
    await settle()
    assert stage.batches[2:] == [[6]] and waiting.result() == 60

    batcher.expect()
    batcher.expect()
    late = asyncio.ensure_future(batcher.submit(7, expected=True))
    await settle()
    clock.advance(0.001)  # never past the delay
    await settle()
    assert stage.batches[3:] == [[7]] and late.result() == 70
    batcher.unexpect()
    await batcher.aclose()


async def test_a_lone_request_never_waits_for_the_batch():
    stage = Stage()
    config = BatchingConfig(max_batch_size=8, max_queue_delay_microseconds=10**6, preferred_batch_size=(4,))
    batcher = make(config, stage)
    batcher.expect()
    assert await batcher.submit(1, expected=True) == 10
    assert stage.batches == [[1]]
    await batcher.aclose()


async def test_a_draining_batcher_sends_what_it_holds_at_once_then_stops():
    """A batcher giving way to a new one (its model loaded again): the queued requests go without waiting out
    their delay, in batches up to max_batch_size, the batch in flight finishes, then it is closed."""
    stage = Stage(gated=True)
    config = BatchingConfig(
        max_batch_size=2, max_queue_delay_microseconds=10**9, max_inflight_batches=1, idle_dispatch=False
    )
    batcher = make(config, stage)
    tasks = await submit_all(batcher, [1, 2, 3])  # one full batch runs; 3 waits out its delay (1,000 s)
    assert stage.batches == [[1, 2]]
    drained = asyncio.ensure_future(batcher.drain())
    await settle()
    assert stage.batches == [[1, 2]] and not drained.done()  # one batch in flight at a time
    stage.release(0)
    await settle()
    assert stage.batches == [[1, 2], [3]]
    stage.release(1)
    await settle()
    assert drained.done() and [t.result() for t in tasks] == [10, 20, 30]
    assert batcher.queue_depth == 0 and batcher.inflight_batches == 0

"""Who gets an instance of a model, and when a request could never get one: requests take idle instances in
turn, a call that the model's own instances wait on goes ahead of the others, a waiter that gives up (its
deadline, its caller gone) leaves the line without taking an instance, and a call is found wedged only
when every instance waits on it or on calls waiting like it."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.protocol.call_chain import ROOT, CallChain
from pipeline.protocol.errors import DeadlineExceeded
from pipeline.stage.pool import InstancePool, Slot


class Idle:
    """An instance that is never run here."""

    device, reason, inline = "cpu", "test", True


def pool_of(count: int) -> InstancePool:
    return InstancePool([Slot(Idle(), f"model-m-1-{i}") for i in range(count)])  # type: ignore[arg-type]


def call_from(*slots: Slot) -> CallChain:
    """The chain of a call made by the requests the slots run now (each nested in the one before)."""
    chain = ROOT
    for slot in slots:
        chain = chain.nested(slot.key)
    return chain


async def waiting(task: asyncio.Task[Slot]) -> asyncio.Task[Slot]:
    await asyncio.sleep(0)  # the task runs until it waits in line
    assert not task.done()
    return task


async def test_requests_take_idle_instances_then_wait_in_turn() -> None:
    pool = pool_of(2)
    first, second = await pool.take(), await pool.take()
    assert first is not second
    later = await waiting(asyncio.ensure_future(pool.take()))
    last = await waiting(asyncio.ensure_future(pool.take()))
    pool.give(second)
    assert await later is second
    pool.give(first)
    assert await last is first


async def test_a_call_the_models_own_instances_wait_on_goes_first() -> None:
    pool = pool_of(2)
    a, b = await pool.take(), await pool.take()
    client = await waiting(asyncio.ensure_future(pool.take()))
    elsewhere = await waiting(asyncio.ensure_future(pool.take(call_from(Slot(Idle(), "other")))))  # type: ignore[arg-type]
    own = await waiting(asyncio.ensure_future(pool.take(call_from(a))))
    pool.give(b)
    assert await own is b
    pool.give(b)
    assert await client is b  # then in turn: a call no instance here waits on is a client's peer
    pool.give(a)
    assert await elsewhere is a


async def test_a_waiter_that_gives_up_leaves_the_line() -> None:
    pool = pool_of(1)
    slot = await pool.take()
    with pytest.raises(DeadlineExceeded, match="not run"):
        await pool.take(timeout=0.01)
    gone = await waiting(asyncio.ensure_future(pool.take()))
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    after = await waiting(asyncio.ensure_future(pool.take()))
    pool.give(slot)
    assert await after is slot


async def test_an_instance_given_to_a_waiter_that_went_away_goes_to_the_next() -> None:
    pool = pool_of(1)
    slot = await pool.take()
    gone = await waiting(asyncio.ensure_future(pool.take()))
    after = await waiting(asyncio.ensure_future(pool.take()))
    pool.give(slot)  # to `gone`, which is cancelled before it runs again
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert await after is slot


async def test_a_call_is_wedged_only_when_every_instance_waits_on_calls_waiting_here() -> None:
    pool = pool_of(2)
    assert not pool.wedged(call_from(Slot(Idle(), "other")))  # type: ignore[arg-type]
    a = await pool.take()
    assert not pool.wedged(call_from(a))  # an instance is idle
    b = await pool.take()
    assert pool.wedged(call_from(a, b))  # one chain through both instances
    assert not pool.wedged(call_from(a))  # b runs a request that waits on nothing here
    from_a = await waiting(asyncio.ensure_future(pool.take(call_from(a))))
    assert pool.wedged(call_from(b))  # a waits on a call in line, b on this one
    # A call that b's earlier request made (and left behind) is not one its next request waits on.
    earlier = call_from(a, b)
    pool.give(b)
    assert await from_a is b
    assert not pool.wedged(earlier)
    assert pool.wedged(call_from(a, b))

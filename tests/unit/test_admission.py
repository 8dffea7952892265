"""`ByteBudget`: what is admitted, what waits, and that nothing taken is lost when a waiter goes away."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.protocol.errors import Unavailable
from pipeline.runtime.admission import FORGET, ByteBudget, cost_of


def test_a_request_is_admitted_while_it_fits_and_always_when_nothing_is_held() -> None:
    budget = ByteBudget(100)
    budget.admit(500)  # larger than the budget, but nothing else is held
    with pytest.raises(Unavailable, match="--max-inflight-mb"):
        budget.admit(1)
    budget.release(500)
    budget.admit(60)
    budget.admit(40)
    with pytest.raises(Unavailable):
        budget.admit(1)
    assert budget.held == 100
    assert ByteBudget(None).stream_limit() is None and budget.stream_limit() == 25


async def test_waiters_are_served_in_turn_and_a_cancelled_one_gives_back_what_it_was_granted() -> None:
    budget = ByteBudget(100)
    budget.admit(90)
    first = asyncio.ensure_future(budget.wait(50))
    second = asyncio.ensure_future(budget.wait(10))
    await asyncio.sleep(0)
    assert not first.done() and not second.done(), "the second waits its turn although 10 would fit"
    with pytest.raises(Unavailable):
        budget.admit(5)  # a unary request does not jump the queue
    budget.release(90)
    await first
    await second
    assert budget.held == 60
    third = asyncio.ensure_future(budget.wait(80))
    await asyncio.sleep(0)
    budget.release(60)  # granted now ...
    third.cancel()  # ... and cancelled before it ran
    with pytest.raises(asyncio.CancelledError):
        await third
    assert budget.held == 0


async def test_the_door_sets_room_aside_for_what_requests_cost_of_late_and_refuses_when_none_is_left() -> (
    None
):
    budget = ByteBudget(100)
    first = await budget.reserve_read()  # nothing held: in, whatever it turns out to be
    second = asyncio.ensure_future(budget.reserve_read())
    await asyncio.sleep(0)
    assert not second.done(), "until a request was read, they are read one at a time"
    budget.read(first, 10)
    budget.admit(cost_of(10))
    assert budget.expected == cost_of(10) == 30
    budget.read(await second, 10)
    budget.admit(30)
    third = await budget.reserve_read()  # 60 held, 30 more fit
    fourth = asyncio.ensure_future(budget.reserve_read())
    await asyncio.sleep(0)
    assert not fourth.done(), "the room left is set aside for the request being read"
    budget.read(third, None)  # its client went away before its message came
    budget.read(await fourth, 10)
    budget.admit(30)
    assert (budget.held, budget.reading) == (90, 0)
    with pytest.raises(Unavailable, match="--max-inflight-mb"):
        await budget.reserve_read()  # refused before anything is read: what is held leaves no room
    budget.release(90)
    budget.read(await budget.reserve_read(), 1)
    assert budget.expected == 30 - 30 // FORGET, "a small request lowers the estimate by a share only"
    assert await ByteBudget(None).reserve_read() == 0


async def test_before_any_request_is_read_the_door_lets_one_in_beside_bytes_held_elsewhere() -> None:
    # An HTTP request (or a stream) holds bytes before any gRPC request was read: the door still lets one in
    # to learn what requests cost, rather than refusing every one for want of an estimate.
    budget = ByteBudget(100)
    budget.charge(10)
    first = await budget.reserve_read()
    second = asyncio.ensure_future(budget.reserve_read())
    await asyncio.sleep(0)
    assert not second.done(), "until a request was read, they are read one at a time"
    budget.read(first, 5)
    budget.read(await second, 5)
    assert budget.expected == cost_of(5)
    budget.charge(80)  # 90 held: 15 more do not fit
    with pytest.raises(Unavailable, match="--max-inflight-mb"):
        await budget.reserve_read()

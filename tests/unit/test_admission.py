"""`ByteBudget`: what is admitted, what waits, and that nothing taken is lost when a waiter goes away."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.protocol.errors import Unavailable
from pipeline.runtime.admission import ByteBudget


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

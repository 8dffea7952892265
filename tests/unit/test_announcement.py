"""An ensemble request's announcements to the batchers of its steps (`Announcement`): each one made is either
taken up by a call queued there or taken back, so no batcher waits for a call that will not come."""

from __future__ import annotations

from pipeline.router.scheduling.dispatch import Announcement


class Counting:
    """A batcher's side of announcements: how many calls it was told of, and how many were taken back."""

    def __init__(self) -> None:
        self.expected = 0
        self.withdrawn = 0

    def expect(self) -> None:
        self.expected += 1

    def unexpect(self) -> None:
        self.withdrawn += 1


def test_a_step_taken_up_is_not_taken_back_and_the_others_are_at_the_end():
    first, second = Counting(), Counting()
    announced = Announcement({0: first, 2: second})  # type: ignore[dict-item]
    assert (first.expected, second.expected) == (1, 1)
    assert announced.take(0) and not announced.take(0) and not announced.take(1)
    announced.release()
    assert (first.withdrawn, second.withdrawn) == (0, 1)
    announced.release()  # released once only
    assert second.withdrawn == 1


def test_a_skipped_step_is_taken_back_at_once():
    batcher = Counting()
    announced = Announcement({1: batcher})  # type: ignore[dict-item]
    announced.withdraw(1)
    assert batcher.withdrawn == 1 and not announced.take(1)


def test_a_fan_out_announces_each_element_and_takes_back_those_not_queued():
    batcher = Counting()
    announced = Announcement({3: batcher})  # type: ignore[dict-item]
    announced.spread(3, batcher, 4)  # type: ignore[arg-type]
    assert batcher.expected == 4, "the request's one announcement became one per element"
    assert announced.take(3) and announced.take(3)
    announced.withdraw(3)  # two elements cancelled before they were queued
    assert batcher.withdrawn == 2 and not announced.take(3)


def test_a_fan_out_of_no_element_takes_its_announcement_back_and_an_unannounced_one_announces_each():
    batcher = Counting()
    announced = Announcement({0: batcher})  # type: ignore[dict-item]
    announced.spread(0, batcher, 0)  # type: ignore[arg-type]
    assert (batcher.expected, batcher.withdrawn) == (1, 1)
    streamed, other = Announcement(), Counting()  # a streaming ensemble's step announces nothing before
    streamed.spread(5, other, 2)  # type: ignore[arg-type]
    assert other.expected == 2 and streamed.take(5) and streamed.take(5) and not streamed.take(5)
    streamed.release()
    assert other.withdrawn == 0

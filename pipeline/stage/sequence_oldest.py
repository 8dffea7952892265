"""How the oldest strategy of Triton's sequence batcher grows an instance's next batch (`take`): its dynamic
batcher, one per instance, over the requests of the instance's sequences that may run
(`pipeline.stage.sequence_batcher`)."""

from __future__ import annotations


def take(
    held: int, waiting: int, preferred: tuple[int, ...], max_batch: int, delay_s: float, left: float
) -> tuple[int, bool, float]:
    """How Triton's dynamic batcher (the oldest strategy's, one per instance) grows an instance's next
    batch, which holds `held` requests, from `waiting` ones of the same shapes, oldest first, the oldest of
    which has `left` seconds of the delay `delay_s` to go: how many join it, whether it is then full, and the
    seconds to wait where none joins yet.

    Counting the requests in turn, the batch takes the largest preferred size it can reach (before the
    oldest has waited the delay), else all of them up to `max_batch` once the largest preferred size is
    reached or passed or the delay is over. A batch that waits for a busy instance takes the requests that
    come, one at a time, while its size is not a preferred one, and becomes full with the request that takes
    it past the largest preferred size. So an instance that has run for longer than the delay finds a batch
    of everything that waited, and a batch of the preferred size may run one larger (as Triton's do).
    """
    sizes = preferred or (max_batch,)
    largest = max(sizes)
    waited_out = delay_s > 0 and left <= 0
    best, count, full, over = 0, 0, False, False
    while count < waiting:
        if held + count:
            if held + count + 1 > largest and not best:
                best, full = count, True
            if held + count + 1 > max_batch:
                over = True
                break
        count += 1
        if held + count in sizes:
            best = count
    if best and not waited_out:
        return best, full or delay_s == 0, 0.0
    if not count:
        return 0, full or over, float("inf")
    if over or held + count >= largest:
        return count, True, 0.0
    if waited_out or delay_s == 0 or (held and held not in sizes):
        return count, full, 0.0
    return 0, full, left

"""The sequence batcher's slots, rows and backlog, with a runner that records what the model would get, and
the rendezvous ranking the router keeps sequences with."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
from google.protobuf import text_format

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import DeadlineExceeded, InvalidInput, RepositoryError, Unavailable
from pipeline.protocol.sequences import SequenceId
from pipeline.router.stages.replicas import rendezvous
from pipeline.stage.api import NO_DEADLINE, Deadline
from pipeline.stage.sequence_batcher import SequenceBatcher
from pipeline.stage.sequence_config import SequenceSettings
from pipeline.stage.sequence_oldest import take
from pipeline.stage.sequence_rows import Row, split_rows

CONFIG = """
max_batch_size: 4
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  %s
  control_input [
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "ID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_INT64 } ] }
  ]
}
"""


def batcher(strategy: str, batches: list[dict[str, np.ndarray]], instances: int = 1) -> SequenceBatcher:
    config = text_format.Parse(CONFIG % strategy, mc.ModelConfig())
    settings = SequenceSettings.of(config, "config.pbtxt")

    async def run(index, merged, rows: list[Row], deadline):
        batches.append({name: array.copy() for name, array in merged.items()})
        return split_rows({"Y": merged["X"] * 10}, len(rows), True), 1

    return SequenceBatcher("m", settings, instances, run)


def x(value: int) -> dict[str, np.ndarray]:
    return {"X": np.array([[value]], np.int32)}


async def test_direct_keeps_each_sequence_in_its_slot_and_pads_the_free_ones() -> None:
    batches: list[dict[str, np.ndarray]] = []
    sequences = batcher(
        "direct { max_queue_delay_microseconds: 100000 minimum_slot_utilization: 1.0 }", batches
    )
    first = [
        asyncio.create_task(sequences.infer(SequenceId(n, True, False), x(n), NO_DEADLINE)) for n in (7, 8, 9)
    ]
    await asyncio.gather(*first)
    # Slots 0, 1, 2 taken by 7, 8, 9; now only 7 and 9 send: the batch holds slot 1 as padding.
    await asyncio.gather(
        sequences.infer(SequenceId(7, False, True), x(70), NO_DEADLINE),
        sequences.infer(SequenceId(9, False, True), x(90), NO_DEADLINE),
    )
    await sequences.close()
    last = batches[-1]
    assert last["X"].reshape(-1).tolist() == [70, 0, 90]
    assert last["READY"].reshape(-1).tolist() == [True, False, True]
    assert last["ID"].reshape(-1).tolist() == [7, 0, 9]


async def test_a_sequence_without_a_free_slot_waits_in_the_backlog_until_one_ends() -> None:
    config = CONFIG % "oldest { max_candidate_sequences: 1 }"
    settings = SequenceSettings.of(text_format.Parse(config, mc.ModelConfig()), "config.pbtxt")
    order: list[int] = []

    async def run(index, merged, rows, deadline):
        order.extend(int(v) for v in merged["ID"].reshape(-1))
        return split_rows({"Y": merged["X"]}, len(rows), True), 1

    sequences = SequenceBatcher("m", settings, 1, run)
    held = await sequences.infer(SequenceId(1, True, False), x(1), NO_DEADLINE)
    # Sequence 2 starts while sequence 1 holds the only slot: it runs once sequence 1 has ended.
    waiting = asyncio.create_task(sequences.infer(SequenceId(2, True, True), x(2), NO_DEADLINE))
    await sequences.infer(SequenceId(1, False, True), x(3), NO_DEADLINE)
    await waiting
    await sequences.close()
    assert held[0]["Y"].tolist() == [[1]] and order == [1, 1, 2]


def test_rendezvous_ranks_alike_everywhere_spreads_keys_and_moves_only_a_gone_addresses() -> None:
    addresses = ["ipv4:10.0.0.1:8001", "ipv4:10.0.0.2:8001", "ipv4:10.0.0.3:8001"]
    keys = [f"n:{i}" for i in range(3000)]
    first = {key: rendezvous(addresses, key)[0] for key in keys}
    assert first == {key: rendezvous(list(reversed(addresses)), key)[0] for key in keys}
    shares = [sum(1 for a in first.values() if a == address) for address in addresses]
    assert all(800 < share < 1200 for share in shares), shares
    left = {key: rendezvous(addresses[1:], key)[0] for key in keys}
    moved = [key for key in keys if left[key] != first[key]]
    assert all(first[key] == addresses[0] for key in moved)


def test_a_state_without_initial_state_starts_as_triton_starts_it() -> None:
    """Zeros, with every variable dimension 1 (Triton leaves the data undefined: the model makes the state on
    the START request)."""
    state = 'state [ { input_name: "S" output_name: "S_OUT" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]'
    config = text_format.Parse(CONFIG % f"direct {{ }} {state}", mc.ModelConfig())
    (state,) = SequenceSettings.of(config, "config.pbtxt").states
    assert state.initial.shape == (1, 3) and not state.initial.any()


def test_what_sequence_batching_cannot_serve_is_refused_naming_the_field() -> None:
    refusals = {
        "response_cache { enable: true }": "response_cache is enabled",
        "model_transaction_policy { decoupled: true }": "a decoupled model",
    }
    for extra, words in refusals.items():
        config = text_format.Parse(CONFIG % "direct { }" + extra, mc.ModelConfig())
        with pytest.raises(RepositoryError, match=words):
            SequenceSettings.of(config, "config.pbtxt")
    config = text_format.Parse((CONFIG % "iterative_sequence: true"), mc.ModelConfig())
    with pytest.raises(
        RepositoryError,
        match=re.escape("config.pbtxt: sequence_batching: iterative_sequence is not supported"),
    ):
        SequenceSettings.of(config, "config.pbtxt")


def test_the_oldest_strategy_grows_a_batch_as_tritons_dynamic_batcher_does() -> None:
    """`take(held, waiting, preferred, max_batch, delay, left)`: how many join the next batch, whether it is
    then full, and how long to wait (preferred size 4, at most 8 rows, a 2 ms delay)."""
    rules = (4,), 8, 0.002
    # An idle instance: the largest preferred size while the oldest is within the delay; after it, all.
    assert take(0, 6, *rules, 0.001) == (4, False, 0.0)
    assert take(0, 6, *rules, -0.001) == (6, True, 0.0)
    assert take(0, 2, *rules, 0.001) == (0, False, 0.001)
    assert take(0, 2, *rules, -0.001) == (2, False, 0.0)
    # A batch waiting for a busy instance: a request joins one of no preferred size at once; one of the
    # preferred size takes one more and is full; a full batch takes none, and no batch passes 8 rows.
    assert take(2, 1, *rules, 0.001) == (1, False, 0.0)
    assert take(4, 1, *rules, 0.001) == (1, True, 0.0)
    assert take(4, 3, *rules, 0.001) == (1, True, 0.0)
    assert take(7, 3, *rules, -0.001) == (1, True, 0.0)
    assert take(8, 1, *rules, -0.001) == (0, True, float("inf"))


async def test_the_oldest_strategy_forms_tritons_batches_of_sequences_sent_up_front() -> None:
    """Six sequences of twelve requests, all queued at once (as on one stream), preferred size 4, at most 8
    rows: as Triton 2.51 does, the batch that waits for the busy instance takes the next requests of the
    batch that runs as they come, in the batch's order, up to 4 and one more; the one it leaves out is first
    in the next, so 15 batches, mostly of 5. (Before, the waiting batch took no request before the instance
    was idle, and the same sequences went first every time, leaving the others to end in small batches.)"""
    config = CONFIG.replace("max_batch_size: 4", "max_batch_size: 8") % (
        "oldest { max_candidate_sequences: 8 preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 500000 }"
    )
    settings = SequenceSettings.of(text_format.Parse(config, mc.ModelConfig()), "config.pbtxt")
    batches: list[str] = []

    async def run(index, merged, rows: list[Row], deadline):
        batches.append("".join(str(row.correlation_id) for row in rows))
        await asyncio.sleep(0)
        return split_rows({"Y": merged["X"]}, len(rows), True), 1

    sequences = SequenceBatcher("m", settings, 1, run)
    steps = [
        sequences.infer(SequenceId(n, step == 0, step == 11), x(step), NO_DEADLINE)
        for step in range(12)
        for n in range(1, 7)
    ]
    await asyncio.gather(*steps)
    await sequences.close()
    rotation = ["56123", "45612", "34561", "23456", "12345", "61234"]
    assert batches == ["1234", *rotation, *rotation, "56123", "456"]


async def test_a_start_waiting_for_a_slot_is_answered_at_its_deadline_and_forgotten() -> None:
    config = CONFIG % "oldest { max_candidate_sequences: 1 }"
    settings = SequenceSettings.of(text_format.Parse(config, mc.ModelConfig()), "config.pbtxt")

    async def run(index, merged, rows, deadline):
        return split_rows({"Y": merged["X"]}, len(rows), True), 1

    sequences = SequenceBatcher("m", settings, 1, run)
    await sequences.infer(SequenceId(1, True, False), x(1), NO_DEADLINE)  # holds the only slot
    with pytest.raises(DeadlineExceeded, match="sequence 2's request to model 'm' started: it was not run"):
        await sequences.infer(SequenceId(2, True, False), x(2), Deadline.after(0.05))
    # Sequence 2 never started: its next request is refused as Triton refuses one without START, and sequence
    # 1 goes on in its slot.
    with pytest.raises(InvalidInput, match="must specify the START flag"):
        await sequences.infer(SequenceId(2, False, False), x(3), NO_DEADLINE)
    (result, _, _) = await sequences.infer(SequenceId(1, False, True), x(4), NO_DEADLINE)
    await sequences.close()
    assert result["Y"].tolist() == [[4]]


async def test_a_sequence_waiting_for_a_slot_past_its_timeout_is_answered_as_triton_answers_it() -> None:
    """A request's `timeout` bounds its sequence's wait in the backlog (Triton 2.51's reaper): every request
    of the sequence is answered UNAVAILABLE then, and the sequence forgotten; one that gets a slot in time
    runs, however long it then waits."""
    config = CONFIG % "oldest { max_candidate_sequences: 1 } max_sequence_idle_microseconds: 600000000"
    settings = SequenceSettings.of(text_format.Parse(config, mc.ModelConfig()), "config.pbtxt")

    async def run(index, merged, rows, deadline):
        return split_rows({"Y": merged["X"]}, len(rows), True), 1

    sequences = SequenceBatcher("m", settings, 1, run)
    await sequences.infer(SequenceId(1, True, False), x(1), NO_DEADLINE)  # holds the only slot
    waiting = [
        asyncio.create_task(sequences.infer(SequenceId(2, True, False, 50_000), x(2), NO_DEADLINE)),
        asyncio.create_task(sequences.infer(SequenceId(2, False, False), x(3), NO_DEADLINE)),
    ]
    for task in waiting:
        with pytest.raises(Unavailable, match=r"^timeout of the corresponding sequence has been expired"):
            await task
    with pytest.raises(InvalidInput, match="must specify the START flag"):
        await sequences.infer(SequenceId(2, False, False), x(4), NO_DEADLINE)
    later = asyncio.create_task(sequences.infer(SequenceId(3, True, True, 5_000_000), x(5), NO_DEADLINE))
    await sequences.infer(SequenceId(1, False, True), x(6), NO_DEADLINE)  # frees the slot for sequence 3
    (result, _, _) = await later
    await sequences.close()
    assert result["Y"].tolist() == [[5]]


def test_a_backlog_bound_that_is_not_a_number_is_refused_naming_the_parameter() -> None:
    extra = 'parameters { key: "pipeline.max_sequence_backlog" value { string_value: "many" } }'
    config = text_format.Parse(CONFIG % "direct { }" + extra, mc.ModelConfig())
    with pytest.raises(
        RepositoryError, match=re.escape("pipeline.max_sequence_backlog is 'many'; expected an integer >= 1")
    ):
        SequenceSettings.of(config, "config.pbtxt")

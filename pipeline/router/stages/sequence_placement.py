"""Which replica of a stage each sequence's requests go to (Triton's sequence batching behind a router):
the replica that holds the sequence's state, never another.

A sequence goes to the replica a router sent it to, else to the first replica that is up in the order its id
ranks them (`Replicas.rank`, rendezvous hashing), which every router, and every worker of one, computes
alike. A router remembers where its sequences went (the most recent `PLACED_LIMIT`), so that a request of a
sequence whose replica has gone is answered at once, UNAVAILABLE naming the sequence, instead of going to a
replica that would start it afresh.
"""

from __future__ import annotations

from collections import OrderedDict

import grpc

from pipeline.protocol.errors import StageError, Unavailable
from pipeline.protocol.sequences import SequenceId, sequence_key
from pipeline.router.stages.replicas import SERVING, UNKNOWN, Replica, Replicas

#: Sequences whose replica a client remembers (the oldest forgotten first).
PLACED_LIMIT = 65536


class SequencePlacement:
    """Where the sequences of one stage went."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        #: Sequence key -> the address of the replica it went to, most recent last.
        self._placed: OrderedDict[str, str] = OrderedDict()

    def candidates(
        self, replicas: Replicas, sequence: SequenceId, model: str, version: str
    ) -> tuple[list[Replica], list[Replica]]:
        """The replicas that may serve the model in the sequence's order, and of those the ones to ask in
        turn: those up (SERVING, else not heard from yet), or only the one that holds the sequence.
        Raises `Unavailable` where that one is no longer serving."""
        key = sequence_key(sequence)
        ranked = replicas.rank(key, model, version)
        up = [r for r in ranked if r.state == SERVING] or [r for r in ranked if r.state == UNKNOWN]
        placed = self._placed.get(key)
        if placed is not None and not sequence.start:
            held = [r for r in up if r.address == placed]
            if not held:
                raise self.lost(sequence, model, placed, "is no longer serving")
            up = held
        return ranked, up

    def placed(self, sequence: SequenceId, address: str) -> None:
        """A request of `sequence` was answered by the replica at `address`: its next ones go there too, until
        its last one."""
        key = sequence_key(sequence)
        self._placed.pop(key, None)
        if not sequence.end:
            self._placed[key] = address
            if len(self._placed) > PLACED_LIMIT:
                self._placed.popitem(last=False)

    def lost(self, sequence: SequenceId, model: str, address: str, why: str) -> Unavailable:
        """The error of a request whose sequence's state was on a replica that `why` says is gone."""
        return Unavailable(
            f"sequence {sequence.value} of model '{model}' is lost: its state was on replica {address} of "
            f"stage '{self.stage}', which {why}; start the sequence again (sequence_start)"
        )


def not_known(error: StageError, sequence: SequenceId) -> bool:
    """Whether a stage refused a request of a sequence as one it does not know (Triton's message)."""
    return (
        error.code == grpc.StatusCode.INVALID_ARGUMENT
        and not sequence.start
        and "must specify the START flag on the first request of the sequence" in str(error)
    )

"""The chain of model calls a request belongs to, when models call models (Triton's BLS).

A model that calls another model from inside its `execute` waits, holding its instance, until the callee
answers. Each such call carries a `CallChain` in its metadata (`CALL_CHAIN_HEADER`, beside the trace
context, and like it on every hop: router, batch, stage): how deep it is nested, and which instances wait
on it, directly or through the calls in between (each named by the request it runs: `Slot.key`). Two
rules follow from it:

- a call nested `MAX_DEPTH` deep is refused, so that a model calling itself (directly or through others)
  ends with an error instead of calling on until memory runs out;
- a stage refuses a call at once when every instance of the callee waits on that very call or on calls
  waiting for an instance like it (a model calling itself with more callers at once than it has instances;
  `pipeline.stage.pool`): Triton's Python backend blocks there forever.

A batch that merges calls of several chains waits for every instance any of them waits for, and is as deep
as the deepest (`CallChain.merged`).

A chain may also name its `origin`: the router's id of the request whose model makes the calls, which the
router puts on every request it forwards to a stage model. The router then knows which of the requests it
holds a call comes from, so that a batched model that such requests call may wait for the calls on their
way (`pipeline.router.scheduling.bls_forecast`).

And it carries the `priority` the client's request asked for (its `priority` parameter; 0: none), which the
router puts on the chain where the request comes in. Every call of the chain inherits it: a batched callee
queues a call that names no priority of its own at that level (its default level where it has fewer).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

#: The metadata key (a request parameter on streams and frames) that carries a call's chain.
CALL_CHAIN_HEADER = "pipeline-call-chain"
#: Calls nested deeper than this are refused: a model that calls itself without end is a bug to report.
MAX_DEPTH = 16


@dataclass(frozen=True, slots=True)
class CallChain:
    """How deep a call is nested (1: called from a model that a client called), the instances that wait
    for it (their `instance` ids, unique across processes), its `origin` ("" where none is known) and the
    `priority` its calls inherit (0: none)."""

    depth: int
    waiting: frozenset[str]
    origin: str = ""
    priority: int = 0

    @classmethod
    def of(cls, metadata: Sequence[tuple[str, str | bytes]]) -> CallChain | None:
        """The chain a call's metadata carries, or None for a call no model made (or an unreadable one)."""
        for key, value in metadata:
            if key == CALL_CHAIN_HEADER and isinstance(value, str):
                return cls.parse(value)
        return None

    @classmethod
    def parse(cls, text: str) -> CallChain | None:
        """The chain `header()` wrote; None for text it did not write."""
        depth, _, rest = text.partition(";")
        if not depth.isdigit():
            return None
        waiting, _, rest = rest.partition(";")
        origin, _, priority = rest.partition(";")
        return cls(
            int(depth),
            frozenset(name for name in waiting.split(",") if name),
            origin,
            int(priority) if priority.isdigit() else 0,
        )

    def header(self) -> str:
        """The chain as its metadata value: `depth;instance,instance,...;origin;priority`."""
        return f"{self.depth};{','.join(sorted(self.waiting))};{self.origin};{self.priority}"

    def nested(self, instance: str) -> CallChain:
        """The chain of a call made by `instance` while it runs a request of this chain."""
        return CallChain(self.depth + 1, self.waiting | {instance}, self.origin, self.priority)

    @staticmethod
    def merged(chains: Iterable[CallChain | None]) -> CallChain | None:
        """The chain of a batch of calls: as deep as its deepest, waited on by every instance that waits on
        any of them, with the highest priority of any (the lowest level); None when no call of the batch
        has a chain."""
        found = [chain for chain in chains if chain is not None]
        if not found:
            return None
        if len(found) == 1:
            return found[0]
        origins = {c.origin for c in found}
        return CallChain(
            max(c.depth for c in found),
            frozenset().union(*(c.waiting for c in found)),
            origins.pop() if len(origins) == 1 else "",
            min((c.priority for c in found if c.priority), default=0),
        )

    @staticmethod
    def prioritized(
        metadata: tuple[tuple[str, str | bytes], ...], priority: int
    ) -> tuple[tuple[str, str | bytes], ...]:
        """`metadata` whose chain (ROOT where it has none) carries `priority`, unless it carries one."""
        chain = CallChain.of(metadata) or ROOT
        if priority <= 0 or chain.priority:
            return metadata
        header = replace(chain, priority=priority).header()
        return (*(item for item in metadata if item[0] != CALL_CHAIN_HEADER), (CALL_CHAIN_HEADER, header))


#: The chain of a call a client made (no model waits on it).
ROOT = CallChain(0, frozenset())

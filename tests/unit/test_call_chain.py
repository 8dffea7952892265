"""The chain of model calls a request belongs to (Triton's BLS): its header, nesting and merging."""

from __future__ import annotations

from pipeline.protocol.call_chain import CALL_CHAIN_HEADER, ROOT, CallChain


def test_a_chain_round_trips_through_its_header_and_nests() -> None:
    chain = ROOT.nested("a").nested("b")
    assert chain == CallChain(2, frozenset({"a", "b"}))
    assert CallChain.of([("x-other", "1"), (CALL_CHAIN_HEADER, chain.header())]) == chain
    assert CallChain.of([("x-other", "1")]) is None
    assert CallChain.parse("not a chain") is None
    assert CallChain.parse("3;") == CallChain(3, frozenset())
    # The origin (the router's id of the request whose model calls) goes along, nested too.
    origin = CallChain(0, frozenset(), "1f.7")
    assert CallChain.parse(origin.nested("a").header()) == CallChain(1, frozenset({"a"}), "1f.7")


def test_a_batch_of_calls_waits_on_every_instance_and_is_as_deep_as_its_deepest() -> None:
    one, other = CallChain(1, frozenset({"a"})), CallChain(4, frozenset({"b", "c"}))
    assert CallChain.merged([one, None, other]) == CallChain(4, frozenset({"a", "b", "c"}))
    assert CallChain.merged([None, None]) is None
    assert CallChain.merged([one]) is one
    # Calls of one origin keep it; of several, none.
    a, b = CallChain(1, frozenset(), "x"), CallChain(1, frozenset(), "y")
    assert CallChain.merged([a, a]) == a
    assert CallChain.merged([a, b]) == CallChain(1, frozenset())


def test_the_priority_a_request_asked_for_goes_along_its_calls() -> None:
    # Put on a client's chain at the router (ROOT where it has none), unless the chain has one already.
    metadata = CallChain.prioritized((("x-other", "1"),), 2)
    assert CallChain.of(metadata) == CallChain(0, frozenset(), "", 2)
    assert ("x-other", "1") in metadata
    assert CallChain.prioritized(metadata, 1) == metadata  # a call keeps what its request asked for
    assert CallChain.prioritized((("x-other", "1"),), 0) == (("x-other", "1"),)
    # Every call of the chain inherits it, through its header and nesting.
    chain = CallChain.of(metadata)
    assert chain is not None
    nested = CallChain.parse(chain.nested("a").header())
    assert nested == CallChain(1, frozenset({"a"}), "", 2)
    # A header without one (written before priorities travelled) reads as none.
    assert CallChain.parse("1;a;1f.7") == CallChain(1, frozenset({"a"}), "1f.7", 0)
    # A batch of calls goes at the highest priority any of them has (the lowest level).
    low, high, none = (
        CallChain(1, frozenset(), "", 3),
        CallChain(1, frozenset(), "", 1),
        CallChain(1, frozenset()),
    )
    assert CallChain.merged([low, none, high]) == CallChain(1, frozenset(), "", 1)
    assert CallChain.merged([none, none]) == CallChain(1, frozenset())

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

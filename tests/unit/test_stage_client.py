"""The stage client's pieces that need no server: target syntax, look-ups, the retry budget and the choice of a
replica for a model."""

from __future__ import annotations

import pytest

from pipeline.router.stages.replicas import DOWN, SERVING, Replicas
from pipeline.router.stages.retry import RetryBudget, StageRetry
from pipeline.router.stages.targets import Target, resolve_dns, tls_name


@pytest.mark.parametrize(
    ("address", "target"),
    [
        ("ipv4:127.0.0.1:1,127.0.0.2:2", Target(fixed=("ipv4:127.0.0.1:1", "ipv4:127.0.0.2:2"))),
        ("ipv6:[::1]:5,[::2]:6", Target(fixed=("ipv6:[::1]:5", "ipv6:[::2]:6"))),
        ("unix:/run/stage.sock", Target(fixed=("unix:/run/stage.sock",))),
        ("dns:///model:8102", Target(host="model", port=8102)),
        ("dns://10.0.0.10:53/model.default.svc:8102", Target(host="model.default.svc", port=8102)),
        ("model:8102", Target(host="model", port=8102)),
        ("[::1]:8102", Target(host="::1", port=8102)),
        ("model", Target(host="model", port=443)),
    ],
)
def test_targets_are_read_in_grpc_syntax(address, target):
    assert Target.parse(address) == target


def test_the_tls_name_is_the_targets_host():
    assert tls_name("dns:///model:8102") == "model"
    assert tls_name("ipv4:127.0.0.1:1,127.0.0.2:2") == "127.0.0.1"
    assert tls_name("localhost:8102") == "localhost"


async def test_a_name_resolves_to_one_address_per_host_preferring_ipv4():
    assert await resolve_dns("localhost", 8102) == ["127.0.0.1:8102"]
    assert await resolve_dns("127.0.0.1", 1) == ["127.0.0.1:1"]


def test_the_retry_budget_is_a_fifth_of_the_calls_plus_a_floor_over_its_window():
    now = [100.0]
    budget = RetryBudget(ratio=0.2, floor=2, window=10.0, clock=lambda: now[0])
    for _ in range(50):
        budget.called()
    granted = sum(budget.try_retry() for _ in range(100))
    assert granted == 12  # 0.2 × 50 + 2
    assert budget.refused == 88
    now[0] += 10.0  # the window has passed: only the floor is left
    assert sum(budget.try_retry() for _ in range(10)) == 2


async def test_a_model_goes_to_the_replicas_that_list_it_then_to_those_that_cannot_say():
    replicas = Replicas(
        "s", "ipv4:127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", max_message_bytes=1 << 20, retry=StageRetry()
    )
    try:
        lists_x, lists_y, cannot_say = replicas.by_address.values()
        for replica in (lists_x, lists_y, cannot_say):
            replicas.set_state(replica, SERVING)
        lists_x.index = {"x": frozenset({"1"})}
        lists_y.index = {"y": frozenset({"1", "2"})}
        for method in ("ModelInfer", "ModelMetadata"):
            assert {replicas.pick(method, set(), "x") for _ in range(20)} == {lists_x}
            assert replicas.pick(method, {lists_x}, "x") is cannot_say
            # Where no replica lists it and none is left that cannot say, one that does not list it answers.
            assert replicas.pick(method, {lists_x, cannot_say}, "x") is lists_y
        assert replicas.pick("ModelInfer", set(), "y", "2") is lists_y
        assert replicas.pick("ModelInfer", set(), "x", "2") is cannot_say
        calls_for_any = {replicas.pick("ModelInfer", set()) for _ in range(50)}
        assert calls_for_any == {lists_x, lists_y, cannot_say}

        assert (replicas.serving("x"), replicas.serving("y"), replicas.serving("z")) == (2, 2, 1)
        replicas.set_state(lists_x, DOWN)
        assert replicas.pick("ModelInfer", set(), "x") is cannot_say
        replicas.set_state(cannot_say, DOWN)
        # The replicas that may serve it are down: none is picked (the call is answered UNAVAILABLE), not one
        # that would answer that it does not know the model.
        assert (replicas.serving("x"), replicas.serving("y")) == (0, 1)
        assert replicas.pick("ModelInfer", set(), "x") is None
    finally:
        await replicas.close()

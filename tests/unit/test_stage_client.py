"""The stage client's pieces that need no server: target syntax, look-ups and the retry budget."""

from __future__ import annotations

import pytest

from pipeline.router.retry import RetryBudget
from pipeline.router.targets import Target, resolve_dns, tls_name


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

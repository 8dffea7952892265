"""The response cache on its own: keys, the byte bound and LRU order, versions, and identical requests."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import DeadlineExceeded
from pipeline.router.caching.response_cache import ENTRY_OVERHEAD, ResponseCache, request_key
from tests.conftest import request_for

V1 = (("m", "1"),)


def key_of(request: pb.ModelInferRequest, versions=V1) -> bytes:
    return request_key("m", versions, request)


def test_the_key_covers_what_decides_the_answer():
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    base = key_of(request_for("m", "a", X=x))
    assert key_of(request_for("m", "b", X=x)) == base  # the request id does not matter
    assert key_of(request_for("m", X=x + 1)) != base  # bytes
    assert key_of(request_for("m", X=x.reshape(2, 2))) != base  # shape
    assert key_of(request_for("m", X=x.view(np.int32))) != base  # datatype, same bytes
    assert key_of(request_for("m", X=x), (("m", "2"),)) != base  # version
    asked = request_for("m", X=x)
    asked.outputs.add(name="Y")
    assert key_of(asked) != base  # requested outputs
    binary = request_for("m", X=x)
    binary.outputs.add(name="Y").parameters["binary_data"].bool_param = True
    assert key_of(binary) == key_of(asked)  # formatting only
    flavoured = request_for("m", X=x)
    flavoured.parameters["flavour"].string_param = "tart"
    assert key_of(flavoured) != base
    scheduled = request_for("m", X=x)
    scheduled.parameters["priority"].int64_param = 1
    scheduled.parameters["timeout"].int64_param = 1000
    assert key_of(scheduled) == base
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="X", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([0, 1, 2, 3])
    assert key_of(typed) == base  # typed contents are the same tensor as raw bytes


def test_least_recently_used_goes_first_and_bytes_stay_within_the_bound():
    size = 3 * (100 + 32 + ENTRY_OVERHEAD)
    cache = ResponseCache(size)
    keys = [bytes([i]) * 32 for i in range(4)]
    for key in keys[:3]:
        assert cache.put(key, b"r" * 100, V1)
    assert cache.get(keys[0]) is not None  # now the most recently used
    cache.put(keys[3], b"r" * 100, V1)
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None
    assert cache.bytes <= size and len(cache) == 3 and cache.evictions == 1
    assert not cache.put(b"k" * 32, b"r" * size, V1)  # larger than the whole cache: not stored
    assert len(cache) == 3


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=8), st.integers(0, 2000)), max_size=60))
def test_the_bound_holds_for_any_stream(items):
    cache = ResponseCache(4096)
    for key, length in items:
        cache.put(key, b"x" * length, V1)
        assert cache.bytes <= 4096
        assert cache.bytes == sum(e.size for e in cache._entries.values())


def test_dropping_a_version_takes_its_entries():
    cache = ResponseCache(1 << 20)
    cache.put(b"a", b"1", (("m", "1"),))
    cache.put(b"b", b"2", (("m", "2"),))
    cache.put(b"c", b"3", (("e", "1"), ("m", "1")))  # an ensemble's entry depends on its steps' versions
    assert cache.drop("m", "1") == 2
    assert cache.get(b"a") is None and cache.get(b"c") is None and cache.get(b"b") == b"2"
    assert cache.versions() == {("m", "2")}
    assert cache.drop("m") == 1 and len(cache) == 0 and cache.bytes == 0


async def test_identical_requests_wait_for_the_one_that_computes():
    cache = ResponseCache(1 << 20)
    release = asyncio.Event()
    computed = 0

    async def compute():
        nonlocal computed
        computed += 1
        await release.wait()
        return b"answer", V1

    tasks = [asyncio.ensure_future(cache.fetch(b"k", compute, deadline=None)) for _ in range(3)]
    while cache.waiting < 2:
        await asyncio.sleep(0)
    release.set()
    results = await asyncio.gather(*tasks)
    assert computed == 1
    assert [(r[0], r[1]) for r in results] == [(b"answer", False), (b"answer", True), (b"answer", True)]


async def test_a_failure_is_not_inherited_one_waiter_computes_instead():
    cache = ResponseCache(1 << 20)
    fail = asyncio.Event()
    calls = 0

    async def compute():
        nonlocal calls
        calls += 1
        if calls == 1:
            await fail.wait()
            raise RuntimeError("the first request's own failure")
        return b"answer", V1

    first = asyncio.ensure_future(cache.fetch(b"k", compute, deadline=None))
    waiters = [asyncio.ensure_future(cache.fetch(b"k", compute, deadline=None)) for _ in range(2)]
    while cache.waiting < 2:
        await asyncio.sleep(0)
    fail.set()
    with pytest.raises(RuntimeError):
        await first
    results = await asyncio.gather(*waiters)
    assert calls == 2  # one waiter computed, the other waited for it
    assert sorted(r[1] for r in results) == [False, True]


async def test_a_waiter_keeps_its_own_deadline():
    cache = ResponseCache(1 << 20)
    never = asyncio.Event()

    async def compute():
        await never.wait()
        return b"answer", V1

    leader = asyncio.ensure_future(cache.fetch(b"k", compute, deadline=None))
    await asyncio.sleep(0)
    with pytest.raises(DeadlineExceeded):
        await cache.fetch(b"k", compute, deadline=time.monotonic())
    assert not leader.done()  # the waiter gave up; the computation goes on
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    assert cache.waiting == 0

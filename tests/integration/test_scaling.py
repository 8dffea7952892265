"""Scaling a stage: batches in flight per replica, load-aware picking, discovery by name, bounded retries."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.errors import InvalidInput, ItemError, Unavailable
from pipeline.protocol.types import TensorSpec
from pipeline.router.stages.stage_client import item_errors
from pipeline.runtime.metrics import Metrics
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, wait_serving


class Echo(Stage):
    """Returns X; counts its calls and can hold them (`hold`), take longer (`delay`) or refuse them all."""

    name = "echo"
    max_batch_size = 16
    inputs = (TensorSpec("X", "FP32", (-1, 2)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 2)),)

    def __init__(self, *, delay: float = 0.0, hold: threading.Event | None = None, refuse: bool = False):
        self.delay, self.hold, self.refuse = delay, hold, refuse
        self.calls = 0
        self.entered = threading.Event()
        self.lock = threading.Lock()

    def infer(self, inputs):
        with self.lock:
            self.calls += 1
        self.entered.set()
        if self.refuse:
            raise Unavailable("echo: queue full")
        if self.hold is not None:
            assert self.hold.wait(20)
        if self.delay:
            time.sleep(self.delay)  # a slow replica: its calls take longer, nothing waits on it
        x = inputs["X"]
        bad = [ItemError("X", int(i), "must not be negative") for i in np.flatnonzero((x < 0).any(axis=1))]
        if bad:
            raise InvalidInput.for_items(bad)
        return {"Y": x}


def ensemble(folder, address: str, batching: str = "") -> None:
    stage = f"{{address: {address!r}{', dynamic_batching: ' + batching if batching else ''}}}"
    (folder / "e.yaml").write_text(
        f"""
name: e
stages:
  s: {stage}
inputs: [{{name: X, datatype: FP32, shape: [-1, 2]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 2]}}]
steps:
  - {{model_name: echo, stage: s, input_map: {{X: X}}, output_map: {{Y: Y}}}}
"""
    )


X = np.array([[1, 2]], np.float32)


class Load:
    """Closed-loop clients sending `e` requests until stopped; every failure is kept."""

    def __init__(self, stub, clients: int = 4) -> None:
        self.stub, self.ok, self.failures = stub, 0, []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        while not self._stop.is_set():
            try:
                await self.stub.ModelInfer(request_for("e", X=X), timeout=20)
                self.ok += 1
            except grpc.aio.AioRpcError as err:
                self.failures.append(err)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_two_replicas_have_two_batches_in_flight(tmp_path):
    release = threading.Event()
    a, b = Echo(hold=release), Echo(hold=release)
    async with serving_stages([a]) as first, serving_stages([b]) as second:
        ensemble(
            tmp_path, f"ipv4:{first.address},{second.address}", "{max_batch_size: 4, max_inflight_batches: 1}"
        )
        metrics = Metrics()
        async with (
            serving_router(load_ensembles([tmp_path]), metrics=metrics) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            calls = [
                asyncio.ensure_future(stub.ModelInfer(request_for("e", X=X), timeout=30)) for _ in range(6)
            ]
            try:
                # Both replicas hold a batch at the same time: one batch in flight per ready replica.
                assert await asyncio.to_thread(a.entered.wait, 15)
                assert await asyncio.to_thread(b.entered.wait, 15)
                # ... and the router says so, per replica, to Prometheus.
                inflight = {
                    sample.labels["replica"]: sample.value
                    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
                    if family.name == "pipeline_stage_inflight_calls"
                    for sample in family.samples
                }
                assert inflight == {f"ipv4:{first.address}": 1, f"ipv4:{second.address}": 1}
            finally:
                release.set()
            for reply in await asyncio.gather(*calls):
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), X)


async def test_a_slow_replica_receives_fewer_calls(tmp_path):
    fast, slow = Echo(), Echo(delay=0.02)
    async with serving_stages([fast]) as first, serving_stages([slow]) as second:
        ensemble(tmp_path, f"ipv4:{first.address},{second.address}")
        async with (
            serving_router(load_ensembles([tmp_path])) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            for _ in range(10):
                await asyncio.gather(*(stub.ModelInfer(request_for("e", X=X), timeout=30) for _ in range(4)))
    assert fast.calls + slow.calls == 40
    assert slow.calls < fast.calls / 2, (fast.calls, slow.calls)


async def test_replicas_found_by_name_join_and_leave_under_load(tmp_path):
    """A replica that a name starts to resolve to gets calls within 10 s; one that leaves costs no request."""
    names: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        assert host == "echo.test"
        return list(names)

    a, b = Echo(), Echo()
    metrics = Metrics()
    async with serving_stages([a]) as first:
        await wait_serving(first.address)
        names.append(first.address)
        ensemble(tmp_path, "dns:///echo.test:8102", "{max_batch_size: 4}")
        async with (
            serving_router(
                load_ensembles([tmp_path]),
                resolve=resolve,
                options={"resolve_interval": 0.2},
                metrics=metrics,
            ) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            load = Load(stub)
            async with serving_stages([b]) as second:
                await wait_serving(second.address)
                names.append(second.address)
                assert await asyncio.to_thread(b.entered.wait, 10), "the new replica got no call within 10 s"
                # Scaled in: gone from the name. The next look-up drops it from the router's replicas (its
                # gauge goes) while it still serves; once the calls sent before have arrived (20 requests
                # later), it gets no more; then it stops.
                replica = {"stage": "s", "replica": second.address}
                assert metrics.registry.get_sample_value("pipeline_stage_inflight_calls", replica) is not None
                names.remove(second.address)
                deadline = time.monotonic() + 10
                while metrics.registry.get_sample_value("pipeline_stage_inflight_calls", replica) is not None:
                    assert time.monotonic() < deadline, "the router kept a replica its name no longer lists"
                    await asyncio.sleep(0.02)
                ok = load.ok
                while load.ok < ok + 20:
                    await asyncio.sleep(0.02)
                seen, ok = b.calls, load.ok
                while load.ok < ok + 20:
                    await asyncio.sleep(0.02)
            ok = load.ok
            while load.ok < ok + 20:
                await asyncio.sleep(0.02)
            await load.stop()
    assert not load.failures, [f.details() for f in load.failures[:3]]
    assert b.calls == seen, "a replica that left still got calls"


async def test_an_overloaded_stage_sees_no_more_retries_than_its_budget(tmp_path):
    a, b = Echo(refuse=True), Echo(refuse=True)
    requests = 100
    async with serving_stages([a]) as first, serving_stages([b]) as second:
        ensemble(tmp_path, f"ipv4:{first.address},{second.address}")
        async with (
            serving_router(load_ensembles([tmp_path])) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            results = await asyncio.gather(
                *(stub.ModelInfer(request_for("e", X=X), timeout=30) for _ in range(requests)),
                return_exceptions=True,
            )
    assert all(isinstance(r, grpc.aio.AioRpcError) for r in results)
    assert {r.code() for r in results} == {grpc.StatusCode.UNAVAILABLE}
    # The budget: retries <= 20% of the calls in the window + 10. Without it each refusal would go to the
    # other replica (200 calls); never to the same one again (at most 2 calls per request here).
    assert requests < a.calls + b.calls <= requests + 0.2 * requests + 10, (a.calls, b.calls)


async def test_k_bad_items_cost_one_more_stage_call(tmp_path):
    release = threading.Event()
    stage = Echo(hold=release)
    async with serving_stages([stage]) as served:
        ensemble(
            tmp_path,
            served.address,
            "{max_batch_size: 16, max_queue_delay_microseconds: 30000000, idle_dispatch: false, "
            "preferred_batch_size: [5]}",
        )
        async with (
            serving_router(load_ensembles([tmp_path])) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            release.set()
            xs = [X, np.array([[1, 1], [-1, 0]], np.float32), X, np.array([[-2, 0]], np.float32)]
            results = await asyncio.gather(
                *(stub.ModelInfer(request_for("e", X=x), timeout=20) for x in xs), return_exceptions=True
            )
    assert stage.calls == 2, "one call refused two items, one call served the rest"
    np.testing.assert_array_equal(response_tensors(results[0])["Y"].to_array(), X)
    np.testing.assert_array_equal(response_tensors(results[2])["Y"].to_array(), X)
    for result, index in ((results[1], 1), (results[3], 0)):
        assert isinstance(result, grpc.aio.AioRpcError) and result.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"X[{index}]: must not be negative" in result.details(), result.details()
        # The router passes the refused item on as details too, with the request's own index.
        assert [(i.field, i.description) for i in item_errors(result)] == [
            (f"X[{index}]", "must not be negative")
        ]


async def test_a_stage_sends_each_refused_item_as_a_field_violation():
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    async with serving_stages([Echo()]) as served, inference_stub(served.address) as stub:
        await wait_serving(served.address)
        x = np.array([[-1, 0], [1, 1], [0, -3]], np.float32)
        try:
            await stub.ModelInfer(request_for("echo", X=x), timeout=10)
        except grpc.aio.AioRpcError as err:
            status = rpc_status.from_call(err)
        else:
            pytest.fail("a negative item was accepted")
    assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [(v.field, v.description) for v in bad.field_violations] == [
        ("X[0]", "must not be negative"),
        ("X[2]", "must not be negative"),
    ]


async def test_a_lone_replica_that_recycles_its_connections_loses_no_call(tmp_path, monkeypatch):
    # Servers end their connections every max_connection_age; the router's health watch of the replica
    # ends with them. Watched again at once, the replica is never taken for down in between.
    import pipeline.runtime.server

    monkeypatch.setenv("PIPELINE_MAX_CONNECTION_AGE_S", "0.3")
    monkeypatch.setattr(pipeline.runtime.server, "MAX_CONNECTION_AGE_GRACE_MS", 100)
    stage = Echo()
    async with serving_stages([stage]) as s:
        await wait_serving(s.address)
        ensemble(tmp_path, s.address)
        async with serving_router(load_ensembles([tmp_path])) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                load = Load(stub, clients=2)
                calls = stage.calls
                while stage.calls < calls + 400:  # some two seconds: several recycled connections
                    await asyncio.sleep(0.05)
                await load.stop()
    assert load.ok > 0 and not load.failures, [f.details() for f in load.failures[:3]]

"""The compiled front merges requests into batches (`front/src/batches.h`): for a stage model the router batches
and an ensemble whose every step it batches, requests that come while the router holds enough of that model's go
to it as one, and each client gets exactly its own rows, its own errors and its own statistics."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_catalog, load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.types import TensorSpec
from pipeline.router import front
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.telemetry import Telemetry
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, wait_serving
from tests.stages import GATE, Held, Scale, write_model

pytestmark = pytest.mark.skipif(front.binary() is None, reason="pipeline-front is not built (make front)")


class Labelled(Scale):
    """Scale's Y = 2X (refusing negative rows, naming the row), and L: each row's sum as text (BYTES)."""

    outputs = (*Scale.outputs, TensorSpec("L", "BYTES", (-1, 1)))

    def infer(self, inputs):
        out = super().infer(inputs)
        out["L"] = np.array([[f"sum {row.sum():g}".encode()] for row in inputs["X"]], dtype=object)
        return out


def _ensemble(name: str, address: str, suffix: str, batching: str) -> str:
    return f"""
name: {name}
stages:
  s{suffix}: {{address: "{address}"{batching}}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}, {{name: L, datatype: BYTES, shape: [-1, 1]}}]
steps:
  - {{model_name: held{suffix}, stage: s{suffix}, input_map: {{X: X}}, output_map: {{Y: H}}}}
  - {{model_name: labelled{suffix}, stage: s{suffix}, input_map: {{X: H}}, output_map: {{Y: Y, L: L}}}}
"""


class Served:
    def __init__(self, address: str, held: dict[str, Held], metrics: Metrics) -> None:
        self.address, self.held, self.metrics = address, held, metrics


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("front-batches")
    held = {"merged": Held("held"), "unmerged": Held("held_plain")}
    for stage in held.values():
        stage.max_batch_size = 64
        stage.release.set()
    async with (
        serving_stages([held["merged"], Labelled("labelled", max_batch_size=64)]) as stage,
        serving_stages([held["unmerged"], Labelled("labelled_plain", max_batch_size=64)]) as plain,
    ):
        batching = ", dynamic_batching: {max_batch_size: 64}"
        (folder / "merged.yaml").write_text(_ensemble("merged", stage.address, "", batching))
        (folder / "unmerged.yaml").write_text(_ensemble("unmerged", plain.address, "_plain", ""))
        metrics = Metrics()
        async with serving_router(
            load_ensembles([folder]), metrics=metrics, options={"front": "compiled"}
        ) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                for model in ("merged", "unmerged"):  # the front learns from an answer what it may merge
                    await stub.ModelInfer(request_for(model, X=np.ones((1, 3), np.float32)), timeout=20)
            yield Served(router.address, held, metrics)


def _rows(i: int) -> np.ndarray:
    """Request i's input: 1 to 3 rows of values of its own."""
    return np.arange(3 * (i % 3 + 1), dtype=np.float32).reshape(-1, 3) + 10 * i


async def _statistics(stub, model: str) -> tuple[int, int, int]:
    """An ensemble's successes, failures and executions."""
    reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))
    stats = reply.model_stats[0]
    return stats.inference_stats.success.count, stats.inference_stats.fail.count, stats.execution_count


def _answered(metrics: Metrics, model: str) -> tuple[float, float]:
    """The router's metrics of a model: requests answered OK, and latencies observed."""
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    ok = sum(
        s.value
        for s in families["pipeline_requests"].samples
        if s.labels == {"model": model, "outcome": "OK"}
    )
    observed = sum(
        s.value
        for s in families["pipeline_request_duration_seconds"].samples
        if s.name.endswith("_count") and s.labels.get("model") == model
    )
    return ok, observed


async def _held_while(held, stub, first: pb.ModelInferRequest, requests: list, metadata=None):
    """Send `first`, and `requests` once the stage holds it at `held` (its `entered` and `release` events), so
    that they wait at the front behind it; each one's reply or error once the stage lets them go."""
    held.release.clear()
    try:
        head = asyncio.ensure_future(stub.ModelInfer(first, timeout=30))
        assert await asyncio.to_thread(held.entered.wait, 10)
        calls = [asyncio.ensure_future(stub.ModelInfer(r, timeout=30, metadata=metadata)) for r in requests]
        # A round trip through the front on the same connection: the requests before it have reached it.
        await stub.ServerLive(pb.ServerLiveRequest(), timeout=10)
    finally:
        held.entered.clear()
        held.release.set()
    await head
    return await asyncio.gather(*calls, return_exceptions=True)


async def test_concurrent_requests_are_merged_and_each_gets_its_own_rows(served):
    requests = [request_for("merged", f"request {i}", X=_rows(i)) for i in range(12)]
    async with inference_stub(served.address) as stub:
        alone = [await stub.ModelInfer(r, timeout=20) for r in requests]  # one at a time: never merged
        before, answered = await _statistics(stub, "merged"), _answered(served.metrics, "merged")
        replies = await _held_while(served.held["merged"], stub, request_for("merged", X=_rows(99)), requests)
        after = await _statistics(stub, "merged")
    assert [a - b for a, b in zip(_answered(served.metrics, "merged"), answered, strict=True)] == [13, 13]
    for i, (reply, single) in enumerate(zip(replies, alone, strict=True)):
        assert not isinstance(reply, BaseException), reply
        assert reply.id == f"request {i}"
        out = response_tensors(reply)
        np.testing.assert_array_equal(out["Y"].to_array(), 2 * _rows(i))
        assert [row[0] for row in out["L"].to_array().tolist()] == [
            f"sum {row.sum():g}".encode() for row in _rows(i)
        ]
        assert reply.SerializeToString(deterministic=True) == single.SerializeToString(deterministic=True)
    successes, failures, executions = (a - b for a, b in zip(after, before, strict=True))
    assert (successes, failures) == (13, 0)
    assert executions < successes, "the requests that waited at the front went to the router merged"


async def test_one_bad_request_among_merged_ones_fails_alone_with_its_own_error(served):
    bad = request_for("merged", "bad", X=np.array([[1, 2, 3], [4, -5, 6]], np.float32))
    requests = [request_for("merged", f"request {i}", X=_rows(i)) for i in range(6)]
    requests.insert(3, bad)
    async with inference_stub(served.address) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as alone:
            await stub.ModelInfer(bad, timeout=20)
        before = await _statistics(stub, "merged")
        results = await _held_while(served.held["merged"], stub, request_for("merged", X=_rows(99)), requests)
        after = await _statistics(stub, "merged")
    err = results.pop(3)
    assert isinstance(err, grpc.aio.AioRpcError)
    assert err.code() == alone.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Its own row named, as alone (the router's batcher words it by the stage call it rode in).
    for details in (err.details(), alone.value.details()):
        assert details.startswith("step 1 (labelled): ")
        assert details.endswith("X[1]: negative values are not allowed")
    for i, reply in enumerate(results):
        assert not isinstance(reply, BaseException), reply
        np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 2 * _rows(i))
    successes, failures, _ = (a - b for a, b in zip(after, before, strict=True))
    assert (successes, failures) == (7, 1), "each request counted once, as it fared alone"


@pytest.mark.parametrize("case", ["no dynamic batching", "traced"])
async def test_requests_are_not_merged_where_they_may_not_be(served, case):
    model = "unmerged" if case == "no dynamic batching" else "merged"
    metadata = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
    requests = [request_for(model, f"request {i}", X=_rows(i)) for i in range(6)]
    async with inference_stub(served.address) as stub:
        before = await _statistics(stub, model)
        replies = await _held_while(
            served.held[model],
            stub,
            request_for(model, X=_rows(99)),
            requests,
            metadata=metadata if case == "traced" else None,
        )
        after = await _statistics(stub, model)
    for i, reply in enumerate(replies):
        assert not isinstance(reply, BaseException), reply
        np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 2 * _rows(i))
    successes, _, executions = (a - b for a, b in zip(after, before, strict=True))
    assert successes == executions == 7


async def test_a_client_that_gives_up_leaves_the_others_answered(served):
    requests = [request_for("merged", f"request {i}", X=_rows(i)) for i in range(6)]
    async with inference_stub(served.address) as stub:
        held = served.held["merged"]
        held.release.clear()
        try:
            head = asyncio.ensure_future(stub.ModelInfer(request_for("merged", X=_rows(99)), timeout=30))
            assert await asyncio.to_thread(held.entered.wait, 10)
            # The third request's client stops waiting (its deadline) while it waits behind the first.
            calls = [
                asyncio.ensure_future(stub.ModelInfer(r, timeout=0.5 if i == 2 else 30))
                for i, r in enumerate(requests)
            ]
            gone = await asyncio.gather(calls[2], return_exceptions=True)
        finally:
            held.entered.clear()
            held.release.set()
        await head
        results = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(gone[0], grpc.aio.AioRpcError) and gone[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for i, reply in enumerate(results):
        if i != 2:
            assert not isinstance(reply, BaseException), reply
            np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 2 * _rows(i))


@contextlib.asynccontextmanager
async def _merging(folder, **options):
    """A router with `options`, behind the compiled front, serving the `merged` ensemble from a stage of its
    own: a stub to it, once the front has learnt what it may merge, and the stage's held model."""
    held = Held("held")
    held.max_batch_size = 64
    held.release.set()
    async with serving_stages([held, Labelled("labelled", max_batch_size=64)]) as stage:
        batching = ", dynamic_batching: {max_batch_size: 64}"
        (folder / "merged.yaml").write_text(_ensemble("merged", stage.address, "", batching))
        options = {"front": "compiled", **options}
        async with serving_router(load_ensembles([folder]), options=options) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                await stub.ModelInfer(request_for("merged", X=np.ones((1, 3), np.float32)), timeout=20)
                held.entered.clear()
                yield stub, held


async def test_a_router_told_not_to_merge_has_its_front_send_every_request_alone(tmp_path):
    requests = [request_for("merged", f"request {i}", X=_rows(i)) for i in range(6)]
    async with _merging(tmp_path, front_merge_inflight=0) as (stub, held):
        before = await _statistics(stub, "merged")
        replies = await _held_while(held, stub, request_for("merged", X=_rows(99)), requests)
        after = await _statistics(stub, "merged")
    for i, reply in enumerate(replies):
        assert not isinstance(reply, BaseException), reply
        np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 2 * _rows(i))
    successes, _, executions = (a - b for a, b in zip(after, before, strict=True))
    assert successes == executions == 7


def _two_steps(name: str, first: str, address: str) -> str:
    """An ensemble of `first`, then labelled, on one stage whose batchers wait up to 30 s for the requests
    they were told are on their way (`batch_upcoming`)."""
    batching = "dynamic_batching: {max_batch_size: 64, max_queue_delay_microseconds: 30000000}"
    return f"""
name: {name}
stages:
  s: {{address: "{address}", {batching}}}
inputs: [{{name: X, datatype: FP32, shape: [-1, 3]}}]
outputs: [{{name: Y, datatype: FP32, shape: [-1, 3]}}, {{name: L, datatype: BYTES, shape: [-1, 1]}}]
steps:
  - {{model_name: {first}, stage: s, input_map: {{X: X}}, output_map: {{Y: H}}}}
  - {{model_name: labelled, stage: s, input_map: {{X: H}}, output_map: {{Y: Y, L: L}}}}
"""


async def test_a_stage_does_not_wait_for_a_request_the_front_batches(tmp_path):
    # Two ensembles share their second step's model. One's request is held at its first step; the other's,
    # reaching the shared step, goes at once: the front batches these ensembles' requests itself (it sends
    # the next batch only when one comes back), so the router does not tell its batchers of them ahead, and
    # no stage waits for them.
    gate = Held("gate")
    gate.max_batch_size = 64
    gate.release.set()
    models = [gate, Scale("scale", max_batch_size=64), Labelled("labelled", max_batch_size=64)]
    async with serving_stages(models) as stage:
        for name, first in (("gated", "gate"), ("scaled", "scale")):
            (tmp_path / f"{name}.yaml").write_text(_two_steps(name, first, stage.address))
        async with serving_router(load_ensembles([tmp_path]), options={"front": "compiled"}) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                for model in ("gated", "scaled"):  # the front learns from an answer what it may merge
                    await stub.ModelInfer(request_for(model, X=_rows(0)), timeout=20)
                gate.entered.clear()
                gate.release.clear()
                try:
                    held = asyncio.ensure_future(
                        stub.ModelInfer(request_for("gated", X=_rows(1)), timeout=60)
                    )
                    assert await asyncio.to_thread(gate.entered.wait, 10)
                    # Told of the held request, labelled's batcher would wait for it (30 s, or until it came).
                    passing = stub.ModelInfer(request_for("scaled", X=_rows(2)), timeout=60)
                    reply = await asyncio.wait_for(passing, 20)
                    assert not held.done(), "the held request was still at its first step"
                finally:
                    gate.release.set()
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 4 * _rows(2))
                np.testing.assert_array_equal(response_tensors(await held)["Y"].to_array(), 2 * _rows(1))


#: A stage model that no ensemble names, batched by the router as its config says: Y = 2X on rows of 3 (a
#: negative row refused, naming it), each call held at `GATE` while it is cleared.
DOUBLED = """
import numpy as np
from pipeline.stage import InvalidInput, ItemError, Stage, TensorSpec
from tests.stages import GATE

class Doubled(Stage):
    max_batch_size = 64
    inputs = (TensorSpec("X", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def infer(self, inputs):
        GATE["entered"].set()
        assert GATE["release"].wait(30)
        x = inputs["X"]
        bad = [ItemError("X", int(i), "negative values are not allowed") for i in np.flatnonzero((x < 0).any(axis=1))]
        if bad:
            raise InvalidInput.for_items(bad)
        return {"Y": 2 * x}
"""

#: Another such model, of text: each row's length and its upper case.
LENGTHS = """
import numpy as np
from pipeline.stage import Stage, TensorSpec
from tests.stages import GATE

class Lengths(Stage):
    max_batch_size = 64
    inputs = (TensorSpec("T", "BYTES", (-1, 1)),)
    outputs = (TensorSpec("N", "INT64", (-1, 1)), TensorSpec("U", "BYTES", (-1, 1)))

    def infer(self, inputs):
        GATE["entered"].set()
        assert GATE["release"].wait(30)
        texts = [row[0] for row in inputs["T"]]
        return {
            "N": np.array([[len(t)] for t in texts], np.int64),
            "U": np.array([[t.upper()] for t in texts], dtype=object),
        }
"""

LENGTHS_CONFIG = """
name: "lengths"
backend: "python"
max_batch_size: 64
input [ { name: "T" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "N" data_type: TYPE_INT64 dims: [ 1 ] }, { name: "U" data_type: TYPE_STRING dims: [ 1 ] } ]
dynamic_batching { }
"""

#: Where `doubled`'s calls wait.
GATED = SimpleNamespace(entered=GATE["entered"], release=GATE["release"])

DOUBLED_CONFIG = """
name: "doubled"
backend: "python"
max_batch_size: 64
input [ { name: "X" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
dynamic_batching { }
"""


@pytest.fixture(scope="module")
async def plain(tmp_path_factory):
    """The router (behind the compiled front) serving `doubled` from a stage's repository, tracing its calls."""
    root = tmp_path_factory.mktemp("plain-batched")
    write_model(root, "doubled", DOUBLED, DOUBLED_CONFIG)
    write_model(root, "lengths", LENGTHS, LENGTHS_CONFIG)
    GATE["release"].set()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()]) as stage:
        catalog = load_catalog(repository=root, stages={"python": stage.address})
        options = {"front": "compiled"}
        async with serving_router(catalog, telemetry=Telemetry(provider), options=options) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:  # the front learns it may merge
                await stub.ModelInfer(request_for("doubled", X=np.ones((1, 3), np.float32)), timeout=20)
                await stub.ModelInfer(request_for("lengths", T=_texts(0)), timeout=20)
            yield Plain(router.address, exporter)


class Plain:
    def __init__(self, address: str, exporter: InMemorySpanExporter) -> None:
        self.address, self.exporter = address, exporter

    def calls(self, model: str = "doubled") -> int:
        """The router's calls of `model` so far: a server span each (none of the clients traced theirs)."""
        return sum(span.name == f"ModelInfer {model}" for span in self.exporter.get_finished_spans())


def _texts(i: int) -> np.ndarray:
    """Request i's text input: 1 to 3 rows of its own, of different lengths (one empty)."""
    return np.array([[f"row {r} of request {i}".encode() * (r % 2)] for r in range(i % 3 + 1)], dtype=object)


async def test_requests_for_a_batched_model_no_ensemble_names_are_merged_and_counted_each(plain):
    requests = [request_for("doubled", f"request {i}", X=_rows(i)) for i in range(12)]
    async with inference_stub(plain.address) as stub:
        before, calls = await _statistics(stub, "doubled"), plain.calls()
        replies = await _held_while(GATED, stub, request_for("doubled", X=_rows(99)), requests)
        after = await _statistics(stub, "doubled")
    assert plain.calls() - calls < 13, "the requests that waited at the front reached the router merged"
    for i, reply in enumerate(replies):
        assert not isinstance(reply, BaseException), reply
        assert reply.id == f"request {i}"
        np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 2 * _rows(i))
    successes, failures, executions = (a - b for a, b in zip(after, before, strict=True))
    assert (successes, failures) == (13, 0), "each client's request counted once"
    assert executions < successes


async def test_a_bad_request_merged_with_others_for_a_batched_model_fails_alone(plain):
    bad = request_for("doubled", "bad", X=np.array([[1, 2, 3], [4, -5, 6]], np.float32))
    requests = [request_for("doubled", f"request {i}", X=_rows(i)) for i in range(6)]
    requests.insert(3, bad)
    async with inference_stub(plain.address) as stub:
        before = await _statistics(stub, "doubled")
        results = await _held_while(GATED, stub, request_for("doubled", X=_rows(99)), requests)
        after = await _statistics(stub, "doubled")
    err = results.pop(3)
    assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().endswith("X[1]: negative values are not allowed"), err.details()
    for i, reply in enumerate(results):
        assert not isinstance(reply, BaseException), reply
        np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 2 * _rows(i))
    successes, failures, _ = (a - b for a, b in zip(after, before, strict=True))
    assert (successes, failures) == (7, 1), "each request counted once, as it fared alone"


async def test_a_flood_of_requests_that_may_merge_meets_the_routers_door_not_the_fronts_memory(tmp_path):
    # The front queues what fills the batches in flight again (two of two rows here); the rest go to the
    # router at once, whose in-flight limit (4: three for one model) refuses what it cannot hold.
    requests = [request_for("merged", f"request {i}", X=_rows(0) + i) for i in range(12)]
    async with _merging(tmp_path, max_batch_items=2, max_inflight_requests=4) as (stub, held):
        results = await _held_while(held, stub, request_for("merged", X=_rows(99)), requests)
    refused = [r for r in results if isinstance(r, BaseException)]
    assert refused, "every request was held at the front, past the router's in-flight limit"
    for err in refused:
        assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "max_inflight_requests 4" in err.details(), err.details()
    answered = [(i, r) for i, r in enumerate(results) if not isinstance(r, BaseException)]
    assert answered, "what the router held, and what waited at the front behind it, answered"
    for i, reply in answered:
        np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), 2 * (_rows(0) + i))


async def test_text_requests_are_merged_and_each_gets_its_own_rows(plain):
    requests = [request_for("lengths", f"request {i}", T=_texts(i)) for i in range(12)]
    # Two rows declared, one element sent: never merged, refused as it is alone.
    bad = request_for("lengths", "bad", T=_texts(0))
    bad.inputs[0].shape[0] = 2
    requests.insert(5, bad)
    async with inference_stub(plain.address) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as alone:
            await stub.ModelInfer(bad, timeout=20)
        calls = plain.calls("lengths")
        replies = await _held_while(GATED, stub, request_for("lengths", T=_texts(99)), requests)
    merged = plain.calls("lengths") - calls
    assert merged < 14, "the requests that waited at the front reached the router merged"
    err = replies.pop(5)
    assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == alone.value.details()
    for i, reply in enumerate(replies):
        assert not isinstance(reply, BaseException), reply
        assert reply.id == f"request {i}"
        out = response_tensors(reply)
        texts = [row[0] for row in _texts(i)]
        assert out["N"].to_array().ravel().tolist() == [len(t) for t in texts]
        assert [row[0] for row in out["U"].to_array().tolist()] == [t.upper() for t in texts]

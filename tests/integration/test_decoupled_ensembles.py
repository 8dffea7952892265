"""Ensembles with a decoupled step through the router: each response of the generating step runs the step
after it, through its batcher (responses of concurrent streams share batches), and reaches the client as a
response of its own, in order, the last final; `max_inflight_requests` bounds what the downstream step
holds; ModelInfer is refused; a client that cancels stops the generating stage."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.streams import is_final
from pipeline.protocol.types import TensorSpec
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.integration.test_decoupled_stages import collect, pipeline_tasks, streamed

pytestmark = pytest.mark.timeout(120)


class Generate(Stage):
    """Yields TOKEN = 100 * PROMPT + i for i < STEPS, one response each; counts what it made, and sets
    `closed` when a generation stops early."""

    name = "generate"
    max_batch_size = 1
    inputs = (TensorSpec("PROMPT", "INT64", (-1, 1)), TensorSpec("STEPS", "INT64", (-1, 1)))
    outputs = (TensorSpec("TOKEN", "INT64", (-1, 1)),)

    def __init__(self) -> None:
        self.made = 0
        self.closed = threading.Event()

    def infer(self, inputs) -> Iterator[dict[str, np.ndarray]]:  # type: ignore[override]
        prompt, steps = inputs["PROMPT"], int(inputs["STEPS"][0, 0])
        finished = False
        try:
            for i in range(steps):
                self.made += 1
                yield {"TOKEN": prompt * 100 + i}
            finished = True
        finally:
            if not finished:
                self.closed.set()


class Detokenize(Stage):
    """TEXT = "t<TOKEN>", batched; remembers every batch size it saw, and waits for `gate` to open."""

    name = "detokenize"
    max_batch_size = 32
    inputs = (TensorSpec("TOKEN", "INT64", (-1, 1)),)
    outputs = (TensorSpec("TEXT", "BYTES", (-1, 1)),)

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def infer(self, inputs):
        tokens = inputs["TOKEN"]
        self.batches.append(len(tokens))
        assert self.gate.wait(30)
        text = np.array([[f"t{int(t)}".encode()] for t in tokens[:, 0]], dtype=object)
        return {"TEXT": text}


ENSEMBLE = """
name: story
max_batch_size: 1
max_inflight_requests: {limit}
stages:
  gen: {{address: "{gen}"}}
  detok:
    address: "{detok}"
    dynamic_batching: {{max_batch_size: 32, max_queue_delay_microseconds: 2000}}
inputs: [{{name: PROMPT, datatype: INT64, shape: [-1, 1]}}, {{name: STEPS, datatype: INT64, shape: [-1, 1]}}]
outputs: [{{name: TEXT, datatype: BYTES, shape: [-1, 1]}}]
steps:
  - {{model_name: generate, stage: gen, input_map: {{PROMPT: PROMPT, STEPS: STEPS}}, output_map: {{TOKEN: token}}}}
  - {{model_name: detokenize, stage: detok, input_map: {{TOKEN: token}}, output_map: {{TEXT: TEXT}}}}
"""


def story(request_id: str, prompt: int, steps: int, empty_final: bool = True) -> pb.ModelInferRequest:
    return streamed(
        "story",
        request_id,
        empty_final=empty_final,
        PROMPT=np.array([[prompt]], np.int64),
        STEPS=np.array([[steps]], np.int64),
    )


def texts(replies: list[pb.ModelStreamInferResponse]) -> list[str]:
    return [
        bytes(response_tensors(r.infer_response)["TEXT"].to_array()[0, 0]).decode()
        for r in replies
        if r.infer_response.outputs
    ]


class Served:
    def __init__(self, router: str, generate: Generate, detokenize: Detokenize) -> None:
        self.router, self.generate, self.detokenize = router, generate, detokenize


async def serve(tmp_path: Path, limit: int = 0):
    generate, detokenize = Generate(), Detokenize()
    gen_stage = serving_stages([generate])
    detok_stage = serving_stages([detokenize])
    gen, detok = await gen_stage.__aenter__(), await detok_stage.__aenter__()
    (tmp_path / "story.yaml").write_text(ENSEMBLE.format(limit=limit, gen=gen.address, detok=detok.address))
    router_context = serving_router(load_ensembles([tmp_path]))
    router = await router_context.__aenter__()
    await wait_serving(router.address)

    async def close() -> None:
        await router_context.__aexit__(None, None, None)
        await detok_stage.__aexit__(None, None, None)
        await gen_stage.__aexit__(None, None, None)

    return Served(router.address, generate, detokenize), close


@pytest.fixture
async def served(tmp_path: Path):
    result, close = await serve(tmp_path)
    try:
        yield result
    finally:
        await close()


async def test_each_generated_token_runs_the_next_step_and_streams_in_order(served: Served) -> None:
    async with inference_stub(served.router) as stub:
        config = await stub.ModelConfig(pb.ModelConfigRequest(name="story"))
        assert config.config.platform == "ensemble"
        call = stub.ModelStreamInfer(timeout=60)
        for request_id, prompt, steps in (("a", 1, 6), ("b", 2, 3), ("c", 3, 1)):
            await call.write(story(request_id, prompt, steps))
        got = await collect(call, {"a", "b", "c"})
        await call.done_writing()
        assert texts(got["a"]) == [f"t{100 + i}" for i in range(6)]
        assert texts(got["b"]) == ["t200", "t201", "t202"]
        assert texts(got["c"]) == ["t300"]
        for replies in got.values():
            assert [is_final(r) for r in replies] == [False] * (len(replies) - 1) + [True]
            assert all(r.infer_response.model_name == "story" for r in replies)


async def test_model_infer_on_a_decoupled_ensemble_is_refused(served: Served) -> None:
    async with inference_stub(served.router) as stub:
        request = request_for("story", PROMPT=np.array([[1]], np.int64), STEPS=np.array([[2]], np.int64))
        err = await rpc_error(stub.ModelInfer(request, timeout=10))
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "decoupled transaction policy" in (err.details() or "")


async def test_responses_of_concurrent_streams_share_the_downstream_batches(served: Served) -> None:
    streams, steps = 32, 8

    async def one(stub, index: int) -> list[str]:
        call = stub.ModelStreamInfer(timeout=60)
        await call.write(story(f"s{index}", index, steps))
        got = await collect(call, {f"s{index}"})
        await call.done_writing()
        return texts(got[f"s{index}"])

    async with inference_stub(served.router) as stub:
        results = await asyncio.gather(*(one(stub, i) for i in range(streams)))
        for index, result in enumerate(results):
            assert result == [f"t{index * 100 + i}" for i in range(steps)]
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="detokenize"))
    [stats] = reply.model_stats
    assert stats.inference_count == streams * steps
    # Fewer executions than responses: the router sent the detokenize step batches across streams.
    assert stats.execution_count < stats.inference_count
    assert max(served.detokenize.batches) > 1


async def test_max_inflight_requests_bounds_the_downstream_step_under_a_slow_consumer(tmp_path: Path) -> None:
    limit, streams, steps = 2, 4, 20
    served, close = await serve(tmp_path, limit)
    served.detokenize.gate.clear()  # the step after the generator is slow: it holds its first batch
    try:
        async with inference_stub(served.router) as stub:

            async def one(index: int) -> list[str]:
                call = stub.ModelStreamInfer(timeout=60)
                await call.write(story(f"slow{index}", index, steps))
                got = await collect(call, {f"slow{index}"})
                await call.done_writing()
                return texts(got[f"slow{index}"])

            running = asyncio.gather(*(one(i) for i in range(streams)))
            # The generating stage makes every token meanwhile (nothing holds it back at the stage).
            for _ in range(1000):
                if served.generate.made == streams * steps:
                    break
                await asyncio.sleep(0.01)
            assert served.generate.made == streams * steps
            # ... but the router let only `limit` of them on to the slow step.
            assert sum(served.detokenize.batches) <= limit
            served.detokenize.gate.set()
            results = await running
        for index, result in enumerate(results):
            assert result == [f"t{index * 100 + i}" for i in range(steps)]
        # Never more than `limit` responses in flight at the step: no batch was larger.
        assert max(served.detokenize.batches) <= limit
    finally:
        served.detokenize.gate.set()
        await close()


async def test_a_client_that_cancels_stops_the_generating_stage(served: Served) -> None:
    async with inference_stub(served.router) as stub:
        # One whole request first: the router's long-lived calls to the stages are open from then on.
        call = stub.ModelStreamInfer(timeout=60)
        await call.write(story("first", 1, 2))
        await collect(call, {"first"})
        await call.done_writing()
        before = pipeline_tasks()
        call = stub.ModelStreamInfer(timeout=60)
        await call.write(story("long", 1, 100_000))
        reply = await call.read()
        assert texts([reply]) == ["t100"]
        call.cancel()
        assert await asyncio.to_thread(served.generate.closed.wait, 20)
        assert served.generate.made < 100_000
    for _ in range(300):
        if not pipeline_tasks() - before:
            break
        await asyncio.sleep(0.01)
    assert not pipeline_tasks() - before, [t.get_coro() for t in pipeline_tasks() - before]

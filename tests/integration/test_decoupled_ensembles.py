"""Ensembles with a decoupled step through the router: each response of the generating step runs the step
after it, through its batcher (responses of concurrent streams share batches), and reaches the client as a
response of its own, in order, the last final; `max_inflight_requests` bounds what the downstream step
holds; ModelInfer is refused; a client that cancels stops the generating stage."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from asyncio.subprocess import PIPE
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_catalog, load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.streams import is_final
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.api import Stage
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.integration.test_decoupled_stages import collect, pipeline_tasks, streamed
from tests.stages import write_model

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
        # A decoupled step makes the ensemble decoupled, and its config says so, as Triton's does.
        assert config.config.model_transaction_policy.decoupled
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
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="story"))
    # The ensemble's responses are counted by their index, as Triton's response_stats: three requests made
    # a first response, two a second and a third, one the fourth to sixth.
    [stats] = reply.model_stats
    made = {int(index): r.success.count for index, r in stats.response_stats.items() if r.success.count}
    assert made == {0: 3, 1: 2, 2: 2, 3: 1, 4: 1, 5: 1}
    assert all(r.fail.count == 0 for r in stats.response_stats.values())


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


GENERATOR_MODEL = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            sender = request.get_response_sender()
            threading.Thread(target=self.generate, args=(sender, int(prompt.ravel()[0]))).start()
        return None

    def generate(self, sender, prompt):
        if prompt == 13:
            error = pb_utils.TritonError(f"unlucky prompt {prompt}", pb_utils.TritonError.INVALID_ARG)
            sender.send(pb_utils.InferenceResponse(error=error))
        else:
            for i in range(prompt):
                token = np.array([[prompt * 100 + i]], dtype=np.int32)
                sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("TOKEN", token)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

GENERATOR_CONFIG = """
name: "gen"
backend: "python"
max_batch_size: 8
input [ { name: "PROMPT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
"""

DETOKENIZER_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKEN").as_numpy()
            text = np.array([[f"<{int(t)}>".encode()] for t in tokens[:, 0]], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("TEXT", text)]))
        return responses
"""

DETOKENIZER_CONFIG = """
name: "detok"
backend: "python"
max_batch_size: 16
input [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
"""

TRITON_ENSEMBLE = """
name: "gen_text"
platform: "ensemble"
max_batch_size: 8
input [ { name: "PROMPT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling {
  max_inflight_requests: 8
  step [
    { model_name: "gen" model_version: -1
      input_map { key: "PROMPT" value: "PROMPT" } output_map { key: "TOKEN" value: "token" } },
    { model_name: "detok" model_version: -1
      input_map { key: "TOKEN" value: "token" } output_map { key: "TEXT" value: "TEXT" } }
  ]
}
"""


#: tritonclient's streaming API, as its users call it, in a process of its own (tritonclient registers
#: Triton's own copy of the protocol's messages): each request's texts in order, and the errors, as JSON.
TRITON_CLIENT = r"""
import json, queue, sys
import numpy as np
import tritonclient.grpc as triton

url, *prompts = sys.argv[1:]
done = queue.Queue()
client = triton.InferenceServerClient(url)
client.start_stream(callback=lambda result, error: done.put((result, error)))
for prompt in prompts:
    value = triton.InferInput("PROMPT", [1, 1], "INT32")
    value.set_data_from_numpy(np.array([[int(prompt)]], np.int32))
    client.async_stream_infer("gen_text", [value], request_id=prompt, enable_empty_final_response=True)
texts, errors, finals = {p: [] for p in prompts}, [], 0
while finals < len(prompts):
    result, error = done.get(timeout=30)
    if error is not None:
        errors.append(str(error))
        continue
    response = result.get_response()
    if result.as_numpy("TEXT") is not None:
        texts[response.id] += [bytes(t).decode() for t in result.as_numpy("TEXT").ravel()]
    if response.parameters["triton_final_response"].bool_param:
        finals += 1
client.stop_stream()
print(json.dumps({"texts": texts, "errors": errors}))
"""


async def test_a_triton_repository_streams_through_the_router_to_tritonclient(tmp_path: Path) -> None:
    root = tmp_path / "repository"
    write_model(root, "gen", GENERATOR_MODEL, GENERATOR_CONFIG)
    write_model(root, "detok", DETOKENIZER_MODEL, DETOKENIZER_CONFIG)
    (root / "gen_text" / "1").mkdir(parents=True)
    (root / "gen_text" / "config.pbtxt").write_text(TRITON_ENSEMBLE)
    async with serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()]) as stage:
        await wait_serving(stage.address)
        catalog = load_catalog(repository=root, stages={"python": stage.address})
        async with serving_router(catalog) as router:
            await wait_serving(router.address)
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-c", TRITON_CLIENT, router.address, "3", "5", "13", stdout=PIPE, stderr=PIPE
            )
            out, err = await asyncio.wait_for(client.communicate(), 60)
            assert client.returncode == 0, err.decode()
            report = json.loads(out)
            texts, errors = report["texts"], report["errors"]
            async with inference_stub(router.address) as stub:
                config = await stub.ModelConfig(pb.ModelConfigRequest(name="gen_text"))
    assert texts["3"] == ["<300>", "<301>", "<302>"]
    assert texts["5"] == [f"<{500 + i}>" for i in range(5)]
    assert texts["13"] == []
    assert len(errors) == 1 and "unlucky prompt 13" in errors[0]
    assert config.config.ensemble_scheduling.max_inflight_requests == 8
    assert config.config.model_transaction_policy.decoupled


async def test_generate_stream_sends_an_event_per_response_and_generate_answers_a_plain_model(
    tmp_path: Path,
) -> None:
    import aiohttp

    _, close = await serve(tmp_path)  # the stages and story.yaml; a second router serves HTTP here
    try:
        async with serving_router(load_ensembles([tmp_path])) as router, aiohttp.ClientSession() as http:
            await wait_serving(router.address)
            base = f"http://{router.http_address}/v2/models"
            async with http.get(f"{base}/story/config") as reply:
                assert reply.status == 200
                assert (await reply.json())["model_transaction_policy"] == {"decoupled": True}
            async with http.get(f"{base}/detokenize/config") as reply:
                assert "model_transaction_policy" not in await reply.json()
            async with http.post(
                f"{base}/story/generate_stream", json={"PROMPT": 2, "STEPS": 3, "id": "g"}
            ) as reply:
                assert reply.status == 200
                assert reply.headers["Content-Type"].startswith("text/event-stream")
                body = (await reply.read()).decode()
            events = [json.loads(line.removeprefix("data: ")) for line in body.split("\n\n") if line]
            assert [e["TEXT"] for e in events] == ["t200", "t201", "t202"]
            assert all(e["model_name"] == "story" and e["id"] == "g" for e in events)
            async with http.post(f"{base}/detokenize/generate", json={"TOKEN": [7]}) as reply:
                assert reply.status == 200, await reply.text()
                assert (await reply.json())["TEXT"] == "t7"
            async with http.post(f"{base}/story/generate_stream", json={"PROMPT": "x", "STEPS": 1}) as reply:
                assert reply.status == 400
                assert "error" in await reply.json()
            async with http.post(f"{base}/story/infer", json={"inputs": []}) as reply:
                assert reply.status >= 400
    finally:
        await close()


async def test_the_first_streamed_request_of_a_decoupled_stage_model_keeps_its_final_flag(
    tmp_path: Path,
) -> None:
    """The router learns that a stage model is decoupled from its first request; that request still gets the
    final flag it asked for (`triton_enable_empty_final_response`)."""
    root = tmp_path / "repository"
    write_model(root, "gen", GENERATOR_MODEL, GENERATOR_CONFIG)
    async with serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()]) as stage:
        await wait_serving(stage.address)
        catalog = load_catalog(repository=root, stages={"python": stage.address})
        async with serving_router(catalog) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            for prompt in (3, 2):  # the first request, then one for a model the router knows is decoupled
                request = streamed("gen", f"p{prompt}", PROMPT=np.array([[prompt]], np.int32))
                replies = [reply async for reply in stub.ModelStreamInfer(iter([request]), timeout=30)]
                assert [is_final(r) for r in replies] == [False] * prompt + [True], prompt
                assert not replies[-1].infer_response.outputs

"""The textgen ensemble streams through the router, as Triton streams a decoupled model in an ensemble:
over `ModelStreamInfer`, one response per generated character, each through the detokenize step, every
response carrying its request's id and the parameter `triton_final_response`, true on the last only. The
router reads the ensemble from the repository's `config.pbtxt` (`--model-dir`), as Triton would."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import Tensor, response_tensors
from pipeline.tools.bench.options import BenchOptions
from pipeline.tools.bench.run import run_bench
from pipeline.tools.client import bytes_batch
from tests.e2e.conftest import REPO, Pipeline, start_pipeline

pytestmark = pytest.mark.e2e

FINAL = "triton_final_response"


@pytest.fixture(scope="module")
def textgen(tmp_path_factory, model_dir) -> Iterator[Pipeline]:
    tmp = tmp_path_factory.mktemp("textgen")
    running = start_pipeline(tmp, model_dir, router_flags=["--model-dir", str(tmp / "models")])
    try:
        yield running
    finally:
        running.stop()


def _request(prompt: bytes, max_tokens: int, request_id: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="textgen", id=request_id)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, array in (
        ("PROMPT", bytes_batch([prompt], (-1, 1))),
        ("MAX_TOKENS", np.array([[max_tokens]], dtype=np.int32)),
    ):
        tensor = Tensor.from_array(name, array)
        request.inputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
        request.raw_input_contents.append(tensor.raw)
    return request


def _stream(
    address: str, requests: list[pb.ModelInferRequest]
) -> dict[str, list[pb.ModelStreamInferResponse]]:
    """Send `requests` on one stream; every response, by request id, up to each request's final one."""
    by_id: dict[str, list[pb.ModelStreamInferResponse]] = defaultdict(list)
    pending = {r.id for r in requests}
    with grpc.insecure_channel(address) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(requests), timeout=120)
        for reply in call:
            request_id = reply.infer_response.id
            by_id[request_id].append(reply)
            params = reply.infer_response.parameters
            if reply.error_message or (FINAL in params and params[FINAL].bool_param):
                pending.discard(request_id)
            if not pending:
                call.cancel()
                break
    return by_id


def _chunks(replies: list[pb.ModelStreamInferResponse]) -> list[bytes]:
    chunks = []
    for reply in replies:
        tensors = response_tensors(reply.infer_response)
        if "TEXT" in tensors:
            (chunk,) = tensors["TEXT"].to_array().reshape(-1)
            chunks.append(bytes(chunk))
    return chunks


def _flags(replies: list[pb.ModelStreamInferResponse]) -> list[bool]:
    return [r.infer_response.parameters[FINAL].bool_param for r in replies]


def test_each_character_is_a_response_and_the_last_is_flagged(textgen) -> None:
    replies = _stream(textgen.router.address, [_request(b"To be, or not", 24, "r1")])["r1"]
    assert not [r.error_message for r in replies if r.error_message]
    chunks = _chunks(replies)
    assert len(chunks) == 24 and all(len(c) == 1 and c.isascii() for c in chunks)
    assert _flags(replies) == [False] * (len(replies) - 1) + [True]


def test_the_generator_runs_in_the_model_service_which_has_the_devices(textgen) -> None:
    """Its config asks for a GPU instance (KIND_GPU), so the model service serves it, on its GPU where it has
    one and on the CPU here; the tokenizer stays in preprocess, the detokenizer in postprocess."""

    def ready(stage: str) -> set[str]:
        with grpc.insecure_channel(textgen.stages[stage].address) as channel:
            index = pb_grpc.GRPCInferenceServiceStub(channel).RepositoryIndex(
                pb.RepositoryIndexRequest(ready=True), timeout=30
            )
        return {model.name for model in index.models if model.name.startswith("textgen")}

    assert ready("model") == {"textgen_generate", "textgen_state"}  # both ask for a GPU
    assert ready("preprocess") == {"textgen_tokenize"}
    assert ready("postprocess") == {"textgen_detokenize"}


def test_interleaved_streams_each_get_their_own_responses_in_order(textgen) -> None:
    requests = [_request(b"Four score", 8 + i, f"s{i}") for i in range(12)]
    by_id = _stream(textgen.router.address, requests)
    assert sorted(by_id) == sorted(r.id for r in requests)
    for i in range(12):
        replies = by_id[f"s{i}"]
        assert len(_chunks(replies)) == 8 + i
        assert _flags(replies)[-1] and not any(_flags(replies)[:-1])


def test_the_detokenize_step_batches_responses_of_many_streams(textgen) -> None:
    with grpc.insecure_channel(textgen.router.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        def stats() -> pb.ModelStatistics:
            (model,) = stub.ModelStatistics(pb.ModelStatisticsRequest(name="textgen_detokenize")).model_stats
            return model

        before = stats()
        by_id = _stream(textgen.router.address, [_request(b"When in", 32, f"b{i}") for i in range(16)])
        after = stats()
    assert sum(len(_chunks(replies)) for replies in by_id.values()) == 16 * 32
    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert inferences >= 16 * 32 and executions < inferences


def test_a_prompt_that_is_not_ascii_is_refused_naming_the_byte(textgen) -> None:
    (reply,) = _stream(textgen.router.address, [_request("café".encode(), 8, "bad")])["bad"]
    assert "PROMPT[0]: byte 0xc3 at 3 is not ASCII text" in reply.error_message


def test_pipeline_infer_stream_prints_the_text(textgen) -> None:
    command = [sys.executable, "-m", "pipeline", "infer", "--url", textgen.router.address, "-m", "textgen"]
    command += ["--stream", "--value", "PROMPT=Shall I", "--value", "MAX_TOKENS=40"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, timeout=120, check=True)
    text = done.stdout.decode("ascii")
    assert len(text) == 41 and text.endswith("\n")


async def test_bench_stream_reports_first_response_and_gaps(textgen) -> None:
    options = BenchOptions(
        url=textgen.router.address,
        model="textgen",
        stream=True,
        values={"PROMPT": "To be", "MAX_TOKENS": "16"},
        concurrency=(4,),
        warmup=0.5,
        duration=2.0,
        progress=False,
    )
    (result,) = (await run_bench(options)).results
    assert result.ok == result.sent and not result.errors
    assert result.stream_responses == 16 * result.window_ok
    assert result.first_response.size == result.window_ok and result.gaps.size == 15 * result.window_ok

"""Large HTTP bodies and JSON responses are decoded and encoded off the router's event loop, which gRPC
shares: gRPC's `ServerLive` answers while they are; a JSON response over `--max-json-output-mb` is
refused, telling the client to ask for binary data; a codec worker that dies fails only the request it
held, and one cancelled request does not free a worker that is still at work."""

from __future__ import annotations

import asyncio
import gzip
import json
import multiprocessing
import os
import signal
import time

import aiohttp
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.errors import Unavailable
from pipeline.protocol.types import TensorSpec
from pipeline.router.frontdoor.codec_pool import WORKER_NAME, CodecPool
from pipeline.stage.api import Stage
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, wait_serving
from tests.integration import codec_work


class Fill(Stage):
    """COUNT (INT64 [N, 1]) -> VALUES: FP32 [N, COUNT] of 0.1, a small request for a large response."""

    name = "fill"
    max_batch_size = 8
    inputs = (TensorSpec("COUNT", "INT64", (-1, 1)),)
    outputs = (TensorSpec("VALUES", "FP32", (-1, -1)),)

    def infer(self, inputs):
        count = inputs["COUNT"]
        return {"VALUES": np.full((count.shape[0], int(count.max())), 0.1, np.float32)}


ENSEMBLE = """
name: filled
stages:
  f: {{address: "{address}"}}
inputs: [{{name: COUNT, datatype: INT64, shape: [-1, 1]}}]
outputs: [{{name: VALUES, datatype: FP32, shape: [-1, -1]}}]
steps:
  - {{model_name: fill, stage: f, input_map: {{COUNT: COUNT}}, output_map: {{VALUES: VALUES}}}}
"""

MAX_MESSAGE_MB = 32
MAX_JSON_OUTPUT_MB = 64
#: The longest a `ServerLive` may take while the router decodes and encodes the requests below. With
#: that work on the event loop (`--http-codec-processes 0`, as the HTTP side did before) it took 9 s and
#: 3 s; off it, 0.1 to 0.5 s, on a 2-core machine shared with other work.
STALL_BOUND_S = 1.0


@pytest.fixture(scope="module")
async def catalog(tmp_path_factory):
    async with serving_stages([Fill()]) as stage:
        folder = tmp_path_factory.mktemp("loop")
        (folder / "filled.yaml").write_text(ENSEMBLE.format(address=stage.address))
        yield load_ensembles([folder])


@pytest.fixture(scope="module")
async def served(catalog):
    options = {"max_json_output_mb": MAX_JSON_OUTPUT_MB}
    async with serving_router(catalog, max_message_mb=MAX_MESSAGE_MB, options=options) as router:
        await wait_serving(router.address)
        assert router.http_address is not None
        async with aiohttp.ClientSession() as session:
            yield router, session


async def longest_stall(address: str, work) -> tuple[float, list]:
    """Run `work` while calling gRPC `ServerLive` on the router back to back; return the longest a call
    took and what `work` returned."""
    longest = 0.0
    done = asyncio.Event()
    async with inference_stub(address) as stub:
        await stub.ServerLive(pb.ServerLiveRequest())  # the channel is connected before timing starts

        async def probe() -> None:
            nonlocal longest
            while not done.is_set():
                started = time.perf_counter()
                await stub.ServerLive(pb.ServerLiveRequest(), timeout=60)
                longest = max(longest, time.perf_counter() - started)

        prober = asyncio.create_task(probe())
        try:
            results = await work()
        finally:
            done.set()
            await prober
    return longest, results


def count_body(count: int, **parameters) -> dict:
    request = {"inputs": [{"name": "COUNT", "datatype": "INT64", "shape": [1, 1], "data": [count]}]}
    if parameters:
        request["parameters"] = parameters
    return request


async def test_compressed_bodies_of_json_strings_leave_grpc_answering(served):
    router, session = served
    # 87 KB of gzip each, that inflate to 16 MB of JSON strings: parsed and refused (COUNT is INT64).
    strings = json.dumps(["abcdefghij"] * 1_300_000)
    text = (
        f'{{"inputs": [{{"name": "COUNT", "datatype": "BYTES", "shape": [1300000, 1], "data": {strings}}}]}}'
    )
    body = gzip.compress(text.encode(), compresslevel=9)
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    url = f"http://{router.http_address}/v2/models/filled/infer"

    async def post() -> tuple[int, str]:
        async with session.post(url, data=body, headers=headers) as reply:
            return reply.status, (await reply.json())["error"]

    async def abuse():
        return await asyncio.gather(*(post() for _ in range(4)))

    stall, answers = await longest_stall(router.address, abuse)
    print(
        f"longest ServerLive during 4 bodies of {len(body) >> 10} KB gzip, {len(text) >> 20} MB JSON: {stall:.3f}s"
    )
    for status, error in answers:
        assert status == 400 and "expected datatype INT64, got BYTES" in error, error
    assert stall < STALL_BOUND_S


async def test_a_large_json_response_is_written_off_the_loop_and_one_too_large_refused(served):
    router, session = served
    url = f"http://{router.http_address}/v2/models/filled/infer"

    async def infer(count: int, **parameters) -> tuple[int, bytes, str | None]:
        async with session.post(url, json=count_body(count, **parameters)) as reply:
            return reply.status, await reply.read(), reply.headers.get("Inference-Header-Content-Length")

    # Two million numbers: 38 MB of JSON, under the limit; written in a worker while gRPC answers.
    stall, (status, body, _) = await longest_stall(router.address, lambda: infer(2_000_000))
    print(f"longest ServerLive while two million numbers were written as JSON: {stall:.3f}s")
    assert status == 200, body[:200]
    values = json.loads(body)["outputs"][0]
    assert values["shape"] == [1, 2_000_000] and len(values["data"]) == 2_000_000
    assert values["data"][:2] == [float(np.float32(0.1))] * 2
    assert stall < STALL_BOUND_S

    # 5 million numbers would be about 95 MB of JSON: refused as estimated, before any of it is written.
    status, body, _ = await infer(5_000_000)
    error = json.loads(body)["error"]
    assert status == 400 and "would be about" in error and "--max-json-output-mb" in error, error
    assert "binary_data_output" in error

    # As binary data, the same response has no such limit.
    status, body, header_length = await infer(5_000_000, binary_data_output=True)
    assert status == 200 and header_length is not None
    assert len(body) - int(header_length) == 5_000_000 * 4


def codec_workers() -> set[int]:
    """The pids of the HTTP codec's workers that run under this process (the routers of these tests)."""
    return {child.pid for child in multiprocessing.active_children() if child.name == WORKER_NAME}


async def test_small_bodies_and_responses_start_no_worker(catalog, served):
    _, session = served
    before = codec_workers()
    async with serving_router(catalog, options={"http_codec_processes": 2}) as fresh:
        await wait_serving(fresh.address)
        url = f"http://{fresh.http_address}/v2/models/filled/infer"
        async with session.post(url, json=count_body(100)) as reply:
            assert reply.status == 200 and len((await reply.json())["outputs"][0]["data"]) == 100
        assert codec_workers() == before
        async with session.post(
            url,
            data=gzip.compress(json.dumps(count_body(100)).encode()),
            headers={"Content-Encoding": "gzip"},
        ) as reply:
            assert reply.status == 200
        started = codec_workers() - before
        assert len(started) == 1  # a compressed body always goes to a worker, started for it
    assert codec_workers() == before  # and stopped with the router


async def test_codec_workers_killed_while_idle_fail_no_request(served):
    router, session = served
    body = gzip.compress(json.dumps(count_body(10)).encode())
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    url = f"http://{router.http_address}/v2/models/filled/infer"

    async def post() -> int:
        async with session.post(url, data=body, headers=headers) as reply:
            assert (await reply.json())["outputs"][0]["data"] == [float(np.float32(0.1))] * 10
            return reply.status

    assert await asyncio.gather(*(post() for _ in range(2))) == [200, 200]  # both workers at work once
    victims = codec_workers()
    assert victims
    for child in multiprocessing.active_children():
        if child.pid in victims:
            os.kill(child.pid, signal.SIGKILL)
            child.join()
    assert await asyncio.gather(*(post() for _ in range(4))) == [200] * 4
    assert codec_workers().isdisjoint(victims)


# --- the pool itself, with work of the tests' own -------------------------------------------------------


@pytest.fixture
def fifos(tmp_path):
    paths = tmp_path / "started", tmp_path / "release"
    for path in paths:
        os.mkfifo(path)
    return tuple(str(path) for path in paths)


async def test_a_worker_that_dies_fails_only_the_request_it_held(fifos):
    started, release = fifos
    pool = CodecPool(2)
    try:
        held = asyncio.create_task(pool.run(codec_work.hold, started, release))
        holder = int(await asyncio.to_thread(read_fifo, started))  # in a worker, until released
        with pytest.raises(Unavailable, match="died"):
            await pool.run(codec_work.die)  # the other worker, killed as the OOM killer would
        await asyncio.to_thread(write_fifo, release)
        assert await held == "released"
        pids = set(await asyncio.gather(pool.run(codec_work.pid), pool.run(codec_work.pid)))
        assert holder in pids and len(pids) == 2  # the survivor, and a worker started anew
    finally:
        await pool.aclose()


async def test_a_cancelled_request_leaves_its_worker_busy_until_the_work_ends(fifos):
    started, release = fifos
    pool = CodecPool(1)
    try:
        held = asyncio.create_task(pool.run(codec_work.hold, started, release))
        holder = int(await asyncio.to_thread(read_fifo, started))
        held.cancel()  # the client went away; the worker is still at its work
        following = asyncio.create_task(pool.run(codec_work.pid))
        await asyncio.to_thread(write_fifo, release)
        # The next request got the worker once it was done, and its own answer, not the cancelled one's.
        assert await following == holder
        with pytest.raises(asyncio.CancelledError):
            await held
    finally:
        await pool.aclose()
    assert codec_workers().isdisjoint({holder})


def read_fifo(path: str) -> str:
    with open(path) as fifo:
        return fifo.read()


def write_fifo(path: str) -> None:
    with open(path, "w") as fifo:
        fifo.write("go")

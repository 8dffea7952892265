"""Faults with real processes killed by PID under load: a model replica SIGKILLed and brought back, a stage
replica SIGTERMed (rolling restart), and the router SIGTERMed with requests in flight. No request that
had time left in its deadline may fail.

`PIPELINE_FAULT_SECONDS` sets the length of the load run (default 16; the figures in docs/reliability.md are from 30).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from examples.digit_images import encode
from examples.models.digits import load_split
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.tools.client import bytes_batch
from tests.conftest import inference_stub, request_for
from tests.e2e.conftest import Pipeline, Process, _start_on_port, start_service, wait_serving

pytestmark = pytest.mark.e2e

SECONDS = float(os.environ.get("PIPELINE_FAULT_SECONDS", "16"))
CONCURRENCY = 32
DEADLINE = 10.0


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, model_dir) -> Iterator[Pipeline]:
    """The digits pipeline with two model replicas behind one `ipv4:` target."""
    tmp = tmp_path_factory.mktemp("faults")
    (tmp / "models").symlink_to(model_dir, target_is_directory=True)
    pipeline = Pipeline({}, None, tmp)  # type: ignore[arg-type]
    for name in ("preprocess", "postprocess"):
        pipeline.start_stage(name)
    model = ["-m", "services.model", "--model-dir", str(tmp / "models")]
    for name in ("model-1", "model-2"):
        pipeline.stages[name] = start_service(name, model, tmp)
    env = {
        "PREPROCESS_ADDRESS": pipeline.stages["preprocess"].address,
        "POSTPROCESS_ADDRESS": pipeline.stages["postprocess"].address,
        "MODEL_ADDRESS": "ipv4:" + ",".join(pipeline.stages[n].address for n in ("model-1", "model-2")),
    }
    router = ["-m", "pipeline", "router", "--model-dir", str(tmp / "models"), "--grace-period", "20"]
    pipeline.router = start_service("router", router, tmp, env)
    for process in [*pipeline.stages.values(), pipeline.router]:
        wait_serving(process)
    try:
        yield pipeline
    finally:
        pipeline.stop()


def images(count: int) -> np.ndarray:
    _, _, x_test, _ = load_split()
    return bytes_batch([encode(x_test[i % len(x_test)]) for i in range(count)], (-1, 1))


async def load(address: str, stop: asyncio.Event, outcomes: Counter[str], batch: int = 4) -> None:
    """`CONCURRENCY` closed-loop clients until `stop`; counts outcomes. A failure that came with time left
    in its deadline counts by its code; a request that outlived its deadline counts as LATE."""
    request = request_for("digits", IMAGE=images(batch))

    async def client() -> None:
        async with inference_stub(address) as stub:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await stub.ModelInfer(request, timeout=DEADLINE)
                    outcomes["OK"] += 1
                except grpc.aio.AioRpcError as err:
                    late = time.monotonic() - started >= DEADLINE
                    outcomes["LATE" if late else err.code().name] += 1
                    outcomes[f"detail: {err.details()[:120]}"] += 1

    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))


async def served(process: Process) -> int:
    async with inference_stub(process.address) as stub:
        reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="digits_cnn"), timeout=5)
    return sum(s.inference_count for s in reply.model_stats)


async def test_replicas_killed_and_terminated_under_load_lose_nothing(replicated: Pipeline, tmp_path):
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()
    running = asyncio.create_task(load(replicated.router.address, stop, outcomes))
    events = []
    began = time.monotonic()

    await asyncio.sleep(SECONDS * 0.2)
    victim = replicated.stages["model-1"]
    os.kill(victim.popen.pid, signal.SIGKILL)  # requests in flight to it must be retried elsewhere
    victim.popen.wait(10)
    events.append(f"{time.monotonic() - began:.1f}s SIGKILL model-1 (pid {victim.popen.pid})")

    await asyncio.sleep(SECONDS * 0.15)
    port = int(victim.address.rsplit(":", 1)[1])
    command = ["-m", "services.model", "--model-dir", str(replicated.tmp / "models")]
    back = _start_on_port("model-1", command, replicated.tmp, port)
    replicated.stages["model-1"] = back
    await asyncio.to_thread(wait_serving, back)
    events.append(f"{time.monotonic() - began:.1f}s model-1 back (pid {back.popen.pid})")

    await asyncio.sleep(SECONDS * 0.25)
    taken_back = await served(back)
    other = replicated.stages["model-2"]
    other.popen.send_signal(signal.SIGTERM)  # a rolling restart: it drains, nothing may fail
    events.append(f"{time.monotonic() - began:.1f}s SIGTERM model-2 (pid {other.popen.pid})")
    code = await asyncio.to_thread(other.popen.wait, 30)
    events.append(f"{time.monotonic() - began:.1f}s model-2 exited with {code}")

    await asyncio.sleep(max(0.0, SECONDS - (time.monotonic() - began)))
    stop.set()
    await running
    elapsed = time.monotonic() - began
    report = {
        "seconds": round(elapsed, 1),
        "concurrency": CONCURRENCY,
        "ok": outcomes["OK"],
        "failed": sum(n for k, n in outcomes.items() if k != "OK" and not k.startswith("detail")),
        "requests_per_s": round(outcomes["OK"] / elapsed, 1),
        "events": events,
        "outcomes": dict(outcomes),
    }
    print(json.dumps(report, indent=1))
    (Path(os.environ.get("PIPELINE_FAULT_REPORT", tmp_path / "faults.json"))).write_text(json.dumps(report))
    assert code == 0
    assert taken_back > 0, "the replica that came back got no calls"
    assert report["failed"] == 0, outcomes
    assert outcomes["OK"] > 0


async def _preprocessed(stub) -> int:
    """Images the router has had through the preprocess step so far."""
    stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="digits_preprocess"), timeout=10)
    return sum(model.inference_count for model in stats.model_stats)


async def test_sigterm_on_the_router_completes_the_requests_it_accepted(replicated: Pipeline):
    request = request_for("digits", IMAGE=images(64))
    # The model replicas are paused, so that every accepted request is still in flight when the signal comes:
    # each waits at the model step once it is through the preprocess step.
    models = [p for n, p in replicated.stages.items() if n.startswith("model") and p.popen.poll() is None]
    async with inference_stub(replicated.router.address) as stub:
        await stub.ModelInfer(request, timeout=30)  # warm
        before = await _preprocessed(stub)
        for model in models:
            model.popen.send_signal(signal.SIGSTOP)
        try:
            calls = [asyncio.ensure_future(stub.ModelInfer(request, timeout=60)) for _ in range(CONCURRENCY)]
            deadline = time.monotonic() + 30
            while await _preprocessed(stub) < before + CONCURRENCY * 64:
                assert time.monotonic() < deadline, "the router did not take every request"
                await asyncio.sleep(0.05)
            pending = sum(not c.done() for c in calls)
            replicated.router.popen.send_signal(signal.SIGTERM)
        finally:
            for model in models:
                model.popen.send_signal(signal.SIGCONT)
        results = await asyncio.gather(*calls, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    assert pending == CONCURRENCY, "a request finished before the signal, with its model paused"
    assert await asyncio.to_thread(replicated.router.popen.wait, 30) == 0

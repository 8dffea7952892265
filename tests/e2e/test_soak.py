"""A bounded soak under overload: the router's memory must plateau while it sheds what it cannot hold.

Four times more clients than the router's in-flight limit send refcnn batches (64 images of 3×64×64 bytes,
768 KiB each) for `PIPELINE_SOAK_SECONDS` (default 40). The router's RSS is sampled twice a second; the
peak of the second half may not exceed the peak of the first by more than half (generous: a leak of the
load's size grows without bound, a plateau does not).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter

import grpc
import numpy as np
import pytest

from tests.conftest import inference_stub, request_for
from tests.e2e.conftest import Pipeline, start_service, wait_serving

pytestmark = pytest.mark.e2e

SECONDS = float(os.environ.get("PIPELINE_SOAK_SECONDS", "40"))
LIMIT = 32  # the router's --max-inflight-requests
CLIENTS = 4 * LIMIT


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
async def test_router_memory_plateaus_under_sustained_overload(tmp_path, model_dir):
    (tmp_path / "models").symlink_to(model_dir, target_is_directory=True)
    pipeline = Pipeline({}, None, tmp_path)  # type: ignore[arg-type]
    try:
        for name in ("preprocess", "model", "postprocess"):
            pipeline.start_stage(name)
        env = {f"{name.upper()}_ADDRESS": p.address for name, p in pipeline.stages.items()}
        command = ["-m", "pipeline", "router", "--model-dir", str(tmp_path / "models")]
        command += ["--max-inflight-requests", str(LIMIT)]
        pipeline.router = start_service("router", command, tmp_path, env)
        for process in [*pipeline.stages.values(), pipeline.router]:
            wait_serving(process)

        batch = np.random.default_rng(0).integers(0, 256, (64, 3, 64, 64), dtype=np.uint8)
        request = request_for("refcnn", IMAGE=batch)
        outcomes: Counter[str] = Counter()
        samples: list[float] = []
        stop = asyncio.Event()

        async def client() -> None:
            async with inference_stub(pipeline.router.address) as stub:
                while not stop.is_set():
                    try:
                        await stub.ModelInfer(request, timeout=30)
                        outcomes["OK"] += 1
                    except grpc.aio.AioRpcError as err:
                        outcomes[err.code().name] += 1
                        if err.code() == grpc.StatusCode.UNAVAILABLE:
                            await asyncio.sleep(0.05)  # a client told to retry later does

        async def sample() -> None:
            while not stop.is_set():
                samples.append(rss_mb(pipeline.router.popen.pid))
                await asyncio.sleep(0.5)

        clients = [asyncio.create_task(client()) for _ in range(CLIENTS)]
        sampler = asyncio.create_task(sample())
        await asyncio.sleep(SECONDS)
        stop.set()
        await asyncio.gather(*clients, sampler)

        half = len(samples) // 2
        first, second = max(samples[:half]), max(samples[half:])
        report = {
            "seconds": SECONDS,
            "clients": CLIENTS,
            "max_inflight_requests": LIMIT,
            "outcomes": dict(outcomes),
            "rss_mb_first_half_peak": round(first, 1),
            "rss_mb_second_half_peak": round(second, 1),
            "rss_mb_start": round(samples[0], 1),
            "rss_mb_every_5s": [round(x) for x in samples[::10]],
        }
        print(json.dumps(report, indent=1))
        assert outcomes["OK"] > 0
        assert outcomes["UNAVAILABLE"] > 0, "no load was shed: the run did not overload the router"
        assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes
        assert second <= first * 1.5, report
        assert pipeline.router.popen.poll() is None
    finally:
        pipeline.stop()

"""`pipeline run --autoscale` as a user runs it, on refcnn: under load the model stage gets a second replica
process, which the router sends calls to once it serves; without load it is removed after the cool-down;
no request fails on the way, and the launcher counts each decision with its reason."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.autoscale import ENSEMBLE, Load
from bench.compare import ensemble_variant
from bench.hardening_supervisor import launch
from pipeline._gen.inference import grpc_service_pb2 as pb
from tests.conftest import inference_stub

pytestmark = pytest.mark.e2e


async def _until(check, what: str, log: Callable[[], str], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            tail = "\n".join(line for line in log().splitlines() if "launcher" in line)[-3000:]
            raise AssertionError(f"timed out waiting for {what}; the launcher said:\n{tail}")
        await asyncio.sleep(0.2)


async def test_the_model_stage_scales_up_under_load_and_down_after_the_cooldown(tmp_path: Path):
    folder = tmp_path / "models"
    folder.mkdir()
    ensemble_variant(folder, batching=True)
    # A queue-time target of 0.1 ms: 4 clients make requests wait longer than that for the one model replica.
    # Calls in flight do not count (--autoscale-inflight 0), so the scale-up is the queue time's (which signal
    # asks most otherwise depends on the moment: the calls in flight did, once in a full suite's run).
    launched = launch(
        folder,
        tmp_path / "run.log",
        "--autoscale",
        "model=1:2",
        "--autoscale-cooldown",
        "3",
        "--autoscale-interval",
        "0.5",
        "--autoscale-queue-ms",
        "0.1",
        "--autoscale-inflight",
        "0",
        "--metrics-port",
        "0",
    )
    load = Load(launched.router)
    outcomes: Counter[str] = Counter()
    try:
        decisions_url = re.search(r"its decisions: (\S+)", launched.output()).group(1)
        load.resize(4, lambda i: ENSEMBLE)
        await _until(
            lambda: "model-2 serves on port" in launched.output(), "the second replica", launched.output
        )
        second = re.search(r"model-2 serves on port (\d+)", launched.output()).group(1)
        # The router reads the stage's file of addresses every second: the new replica gets calls soon after.
        deadline = time.monotonic() + 30
        async with inference_stub(f"127.0.0.1:{second}") as stub:
            while True:
                stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="refcnn_cnn"))
                if stats.model_stats[0].execution_count > 0:
                    break
                assert time.monotonic() < deadline, "the router sent the new replica nothing"
                await asyncio.sleep(0.2)

        await load.close()
        outcomes = Counter(load.outcomes)
        await _until(lambda: "model-2 stopped" in launched.output(), "the scale-down", launched.output)
        load = Load(launched.router)
        load.resize(1, lambda i: ENSEMBLE)
        await _until(lambda: load.outcomes["OK"] > 10, "calls after the scale-down", launched.output)
        with urllib.request.urlopen(decisions_url, timeout=5) as reply:
            metrics = reply.read().decode()
        counted: Counter[tuple[str, str]] = Counter()
        for family in text_string_to_metric_families(metrics):
            for sample in family.samples:
                if sample.name == "pipeline_autoscaler_decisions_total" and sample.labels["stage"] == "model":
                    counted[sample.labels["direction"], sample.labels["reason"]] += sample.value
        assert counted.get(("up", "queue_time"), 0) >= 1, counted
        assert sum(n for (direction, _), n in counted.items() if direction == "down") >= 1, counted
        assert sum(n for (direction, _), n in counted.items() if direction == "hold") >= 1, counted
    finally:
        await load.close()
        launched.stop()
    outcomes.update(load.outcomes)
    failed = {k: v for k, v in outcomes.items() if k != "OK"}
    assert not failed, failed

"""A stage process that hangs (SIGSTOP: its sockets stay open, nothing answers) is noticed within seconds:
the ensembles on it turn not-ready, and ready again once it answers (SIGCONT)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.server import INFERENCE_SERVICE
from pipeline.tools.testing import serving_router
from tests.conftest import inference_stub, request_for, wait_serving
from tests.e2e.conftest import REPO, start_service

ENSEMBLE = """
name: top1
stages:
  post: {{address: "{address}"}}
inputs: [{{name: LOGITS, datatype: FP32, shape: [-1, 10]}}]
outputs: [{{name: LABEL, datatype: INT64, shape: [-1, 1]}}]
steps:
  - {{model_name: refcnn_postprocess, stage: post, input_map: {{LOGITS: LOGITS}}, output_map: {{LABEL: LABEL}}}}
"""

#: How soon a hung stage must be noticed, and a thawed one served again.
NOTICED_WITHIN_S = 15.0

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _readiness_becomes(watch: grpc.aio.UnaryStreamCall, status: int, timeout: float) -> float:
    """Wait for the router's readiness (its health Watch of the inference service) to report `status`;
    return how long it took."""
    started = time.monotonic()

    async def reported() -> None:
        async for reply in watch:
            if reply.status == status:
                return
        raise AssertionError("the router's health watch ended")

    await asyncio.wait_for(reported(), timeout)
    return time.monotonic() - started


async def _http_ready(session: aiohttp.ClientSession, http: str) -> int:
    async with session.get(f"http://{http}/v2/models/top1/ready") as reply:
        return reply.status


async def test_a_stage_frozen_by_sigstop_turns_its_ensembles_unready_and_back(tmp_path: Path):
    stage = start_service(
        "postprocess",
        [
            "-m",
            "services.postprocess",
            "--model-dir",
            str(REPO / "model_repository"),
            "--load-model",
            "refcnn_postprocess",
        ],
        tmp_path,
    )
    logits = np.eye(1, 10, 3, dtype=np.float32)
    try:
        await wait_serving(stage.address, timeout=60)
        (tmp_path / "top1.yaml").write_text(ENSEMBLE.format(address=stage.address))
        async with (
            serving_router(load_ensembles([tmp_path])) as router,
            inference_stub(router.address) as stub,
            grpc.aio.insecure_channel(router.address) as channel,
            aiohttp.ClientSession() as session,
        ):
            await wait_serving(router.address)
            assert router.http_address is not None
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE)
            )
            await _readiness_becomes(watch, SERVING, 30)
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="top1"))).ready
            assert await _http_ready(session, router.http_address) == 200

            os.kill(stage.popen.pid, signal.SIGSTOP)
            try:
                took = await _readiness_becomes(watch, NOT_SERVING, NOTICED_WITHIN_S)
                assert not (await stub.ModelReady(pb.ModelReadyRequest(name="top1"))).ready
                assert await _http_ready(session, router.http_address) == 400
            finally:
                os.kill(stage.popen.pid, signal.SIGCONT)
            print(f"hung stage noticed after {took:.1f}s")

            took = await _readiness_becomes(watch, SERVING, NOTICED_WITHIN_S)
            print(f"thawed stage serving again after {took:.1f}s")
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="top1"))).ready
            assert await _http_ready(session, router.http_address) == 200
            reply = await stub.ModelInfer(request_for("top1", LOGITS=logits), timeout=10)
            assert response_tensors(reply)["LABEL"].to_array().tolist() == [[3]]
            watch.cancel()
    finally:
        os.kill(stage.popen.pid, signal.SIGCONT)
        stage.stop()

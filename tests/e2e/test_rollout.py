"""A model rolled out with `RepositoryModelLoad` while clients run, with real processes: version 2 of the
digits CNN is written into the repository and loaded on the model service under the load of 32 closed-loop
clients through the router. No request may fail, and version 2 answers afterwards (version 1 is retired:
Triton's default version policy serves the latest version only).

scripts/ci-docker.sh does the same in Compose, on every replica of the model service.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from tests.conftest import inference_stub, request_for
from tests.e2e.conftest import Pipeline, start_pipeline
from tests.e2e.test_faults import load

pytestmark = pytest.mark.e2e

MODEL = "digits_cnn"


@pytest.fixture(scope="module")
def rollout(tmp_path_factory, model_dir) -> Iterator[Pipeline]:
    """The digits pipeline on a repository of its own (this module writes a version into it)."""
    tmp = tmp_path_factory.mktemp("rollout")
    repository = tmp / "repository"
    shutil.copytree(model_dir, repository, ignore=shutil.ignore_patterns(".engines", "__pycache__"))
    # Loading a model needs repository control, as in Triton (--model-control-mode explicit).
    running = start_pipeline(tmp, repository, stage_flags=["--model-control-mode", "explicit"])
    try:
        yield running
    finally:
        running.stop()


def write_version(repository: Path, model: str, version: str) -> None:
    """Add a version folder as a deployment would: built aside, then renamed into place in one step."""
    source = repository / model / "1"
    staging = repository / model / f".{version}.partial"
    shutil.copytree(source, staging)
    staging.rename(repository / model / version)


async def versions_served(address: str) -> list[str]:
    async with inference_stub(address) as stub:
        reply = await stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL), timeout=5)
    return list(reply.versions)


async def answering_version(address: str) -> str:
    """The version that answers a request naming none, as the router's steps send them."""
    request = request_for(MODEL, INPUT=np.zeros((1, 1, 8, 8), np.float32))
    async with inference_stub(address) as stub:
        reply = await stub.ModelInfer(request, timeout=10)
    return reply.model_version


async def test_a_new_version_loaded_under_load_loses_nothing_and_answers(rollout: Pipeline) -> None:
    model = rollout.stages["model"].address
    assert await versions_served(model) == ["1"]
    assert await answering_version(model) == "1"
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()
    began = time.monotonic()
    running = asyncio.create_task(load(rollout.router.address, stop, outcomes))
    await asyncio.sleep(3)
    before = outcomes["OK"]

    write_version((rollout.tmp / "models").resolve(), MODEL, "2")
    loading = time.monotonic()
    async with inference_stub(model) as stub:
        await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL), timeout=60)
    loaded = time.monotonic() - loading

    await asyncio.sleep(3)
    stop.set()
    await running
    failed = sum(n for key, n in outcomes.items() if key != "OK" and not key.startswith("detail"))
    print(
        json.dumps(
            {
                "seconds": round(time.monotonic() - began, 1),
                "ok": outcomes["OK"],
                "ok_before_load": before,
                "load_seconds": round(loaded, 2),
                "failed": failed,
                "outcomes": dict(outcomes),
            }
        )
    )
    assert failed == 0, outcomes
    assert before > 0 and outcomes["OK"] > before
    assert await versions_served(model) == ["2"]
    assert await answering_version(model) == "2"
    # Version 1 is retired: a request for it by number is refused.
    request = request_for(MODEL, INPUT=np.zeros((1, 1, 8, 8), np.float32))
    request.model_version = "1"
    async with inference_stub(model) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ModelInfer(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value.details()

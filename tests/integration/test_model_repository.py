"""The model repository over real gRPC: index, load, unload, rollback and versions while requests are in
flight (none may fail), and instances. The model service runs in-process through `serve_stages` with its
`RepositoryPlane`, on torch CPU (the path every machine has)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.convert import response_tensors
from pipeline.server import serve_stages
from services.model.digits import DigitsCNN, load_split, train
from services.model.plane import RepositoryPlane, ServiceSettings
from services.model.repository import ModelRepository
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving

MODELS = ("digits_cnn", "refcnn_cnn")  # MiniLM is left out: it adds seconds and nothing to the lifecycle


@contextlib.asynccontextmanager
async def serving_repository(
    root: Path, models: tuple[str, ...] = MODELS
) -> AsyncIterator[tuple[str, RepositoryPlane]]:
    """The model service on 127.0.0.1 and a port the OS picks, serving `root`; yields its address and plane."""
    args = argparse.Namespace(
        host="127.0.0.1", port=0, port_file=None, max_message_mb=64, grace_period=5.0, metrics_port=None
    )
    planes: list[RepositoryPlane] = []

    def make_plane(telemetry, metrics) -> RepositoryPlane:
        plane = RepositoryPlane(
            ModelRepository(root),
            ServiceSettings(backend="auto", device="cpu"),
            telemetry=telemetry,
            metrics=metrics,
            models=models,
        )
        planes.append(plane)
        return plane

    stopping = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_stages(
            [], args, service="model", stopping=stopping, bound=port.set_result, make_plane=make_plane
        )
    )
    await asyncio.wait({task, port}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    address = f"127.0.0.1:{port.result()}"
    try:
        await wait_serving(address, timeout=60)
        yield address, planes[0]
    finally:
        stopping.set()
        await task


@pytest.fixture(scope="module")
def trained_versions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with digits_cnn versions 1 and 2 (different seeds, so different answers)."""
    root = tmp_path_factory.mktemp("trained")
    train(root, epochs=3, seed=0, progress=False, version="1")
    train(root, epochs=3, seed=1, progress=False, version="2")
    return root


def repo_with(tmp_path: Path, trained: Path, versions: tuple[str, ...], config: dict | None = None) -> Path:
    root = tmp_path / "models"
    folder = root / "digits_cnn"
    folder.mkdir(parents=True)
    shutil.copy(trained / "digits_cnn" / "config.yaml", folder / "config.yaml")
    if config is not None:
        (folder / "config.yaml").write_text(json.dumps(config))
    for version in versions:
        shutil.copytree(trained / "digits_cnn" / version, folder / version)
    return root


def reference_logits(trained: Path, version: str, images: np.ndarray) -> np.ndarray:
    module = DigitsCNN()
    module.load_state_dict(torch.load(trained / "digits_cnn" / version / "model.pt", weights_only=True))
    with torch.inference_mode():
        return module.eval()(torch.from_numpy(images)).numpy()


IMAGES = load_split()[2][:8]


async def infer(stub, version: str = "") -> tuple[str, np.ndarray]:
    request = request_for("digits_cnn", INPUT=IMAGES)
    request.model_version = version
    reply = await stub.ModelInfer(request, timeout=30)
    return reply.model_version, response_tensors(reply)["LOGITS"].to_array()


class Traffic:
    """Clients sending requests back to back until stopped; every reply is kept, every failure too."""

    def __init__(self, stub, clients: int = 4) -> None:
        self.stub = stub
        self.replies: list[str] = []
        self.failures: list[BaseException] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        while not self._stop.is_set():
            try:
                version, _ = await infer(self.stub)
                self.replies.append(version)
            except Exception as exc:
                self.failures.append(exc)
            await asyncio.sleep(0)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_index_metadata_and_config(tmp_path: Path, trained_versions: Path) -> None:
    root = repo_with(tmp_path, trained_versions, ("1", "2"))
    async with serving_repository(root) as (address, _), inference_stub(address) as stub:
        meta = await stub.ServerMetadata(pb.ServerMetadataRequest())
        assert "model_repository" in meta.extensions
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        states = {(m.name, m.version): (m.state, m.reason) for m in index.models}
        # latest 1 (the default policy): version 2 serves, version 1 is on disk but not served.
        assert states[("digits_cnn", "2")] == ("READY", "")
        assert states[("digits_cnn", "1")][0] == "UNAVAILABLE"
        assert states[("refcnn_cnn", "1")] == ("READY", "")
        ready = await stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
        assert all(m.state == "READY" for m in ready.models) and len(ready.models) == 2
        metadata = await stub.ModelMetadata(pb.ModelMetadataRequest(name="digits_cnn"))
        assert list(metadata.versions) == ["2"] and metadata.platform == "pytorch_libtorch"
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="digits_cnn"))).config
        assert config.backend == "pytorch" and config.max_batch_size == 256
        assert config.version_policy.latest.num_versions == 1
        assert config.parameters["precision"].string_value == "fp32"
        assert "instance is on the CPU" in config.parameters["backend_reason"].string_value
        assert [(g.kind, g.count) for g in config.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 1)]
        version, logits = await infer(stub)
        assert version == "2"
        np.testing.assert_allclose(
            logits, reference_logits(trained_versions, "2", IMAGES), rtol=1e-5, atol=1e-5
        )
        error = await rpc_error(infer(stub, "1"))
        assert error.code() == grpc.StatusCode.NOT_FOUND and "no version '1'" in error.details()


async def test_load_rollback_and_unload_under_traffic(tmp_path: Path, trained_versions: Path) -> None:
    root = repo_with(tmp_path, trained_versions, ("1",))
    async with serving_repository(root) as (address, plane), inference_stub(address) as stub:
        traffic = Traffic(stub)
        while len(traffic.replies) < 20:
            await asyncio.sleep(0.01)

        # A new version appears and is loaded while requests run: none fails, and new requests get it.
        shutil.copytree(trained_versions / "digits_cnn" / "2", root / "digits_cnn" / "2")
        await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="digits_cnn"))
        assert (await infer(stub))[0] == "2"
        seen = len(traffic.replies)
        while len(traffic.replies) < seen + 20:
            await asyncio.sleep(0.01)

        # A broken version 3: the load fails, says why, and version 2 keeps serving (rollback).
        broken = root / "digits_cnn" / "3"
        broken.mkdir()
        (broken / "model.pt").write_bytes(b"not a torch archive")
        error = await rpc_error(
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="digits_cnn"))
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot read model weights" in error.details() and "still serving: 2" in error.details()
        assert (await infer(stub))[0] == "2"
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        reasons = {m.version: m.reason for m in index.models if m.name == "digits_cnn"}
        assert "load failed" in reasons["3"]

        # Fixed: version 3 loads and takes over.
        shutil.rmtree(broken)
        shutil.copytree(trained_versions / "digits_cnn" / "1", broken)
        await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="digits_cnn"))
        assert (await infer(stub))[0] == "3"
        await traffic.stop()
        assert traffic.failures == []
        assert {"1", "2", "3"} <= set(traffic.replies)
        # The versions replaced were unloaded once their requests had finished.
        assert list(plane._models["digits_cnn"].versions) == ["3"]

        # Unload: refused from then on, listed as unloaded, and a load brings it back.
        await stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="digits_cnn"))
        error = await rpc_error(infer(stub))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "unloaded" in error.details()
        ready = await stub.ModelReady(pb.ModelReadyRequest(name="digits_cnn"))
        assert not ready.ready
        assert (await stub.ServerReady(pb.ServerReadyRequest())).ready  # an unloaded model is not a fault
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        assert {m.reason for m in index.models if m.name == "digits_cnn"} == {"unloaded"}
        await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="digits_cnn"))
        assert (await infer(stub))[0] == "3"
        # Unknown names are NOT_FOUND.
        error = await rpc_error(stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="nope")))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "no folder" in error.details()
        error = await rpc_error(
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="nope"))
        )
        assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_client_asks_for_a_version(tmp_path: Path, trained_versions: Path) -> None:
    root = repo_with(tmp_path, trained_versions, ("1", "2"))
    async with serving_repository(root) as (address, _), inference_stub(address) as stub:
        # The `config` parameter overrides config.yaml for this load: serve every version.
        request = pb.RepositoryModelLoadRequest(model_name="digits_cnn")
        request.parameters["config"].string_param = json.dumps({"version_policy": {"all": {}}})
        await stub.RepositoryModelLoad(request)
        metadata = await stub.ModelMetadata(pb.ModelMetadataRequest(name="digits_cnn"))
        assert list(metadata.versions) == ["1", "2"]
        for version in ("1", "2"):
            answered, logits = await infer(stub, version)
            assert answered == version
            expected = reference_logits(trained_versions, version, IMAGES)
            np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
        assert (await infer(stub))[0] == "2"
        bad = pb.RepositoryModelLoadRequest(model_name="digits_cnn")
        bad.parameters["config"].string_param = json.dumps(
            {"version_policy": {"specific": {"versions": [7]}}}
        )
        error = await rpc_error(stub.RepositoryModelLoad(bad))
        assert "version 7" in error.details() or "version(s) 7" in error.details()
        assert list((await stub.ModelMetadata(pb.ModelMetadataRequest(name="digits_cnn"))).versions) == [
            "1",
            "2",
        ]


async def test_instances_share_the_requests(tmp_path: Path, trained_versions: Path) -> None:
    config = {"architecture": "digits_cnn", "instance_group": [{"count": 3, "kind": "cpu"}]}
    root = repo_with(tmp_path, trained_versions, ("1",), config=config)
    async with serving_repository(root, ("digits_cnn",)) as (address, plane), inference_stub(address) as stub:
        cfg = (await stub.ModelConfig(pb.ModelConfigRequest(name="digits_cnn"))).config
        assert [(g.kind, g.count) for g in cfg.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 3)]
        served = plane._models["digits_cnn"].versions["1"]
        assert [i.runner.device for i in served.instances] == ["cpu"] * 3
        assert len({i.executor for i in served.instances}) == 3
        await asyncio.gather(*(infer(stub) for _ in range(60)))
        used = [i.finished for i in served.instances]
        assert sum(used) >= 60 and sum(1 for n in used if n) >= 2, used

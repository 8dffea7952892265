"""The model service's fallback between runners, over real gRPC on the CPU.

The preferred runner fails for real: a TorchScript model whose operator (`aten::linalg_cholesky`) the ONNX
exporter does not know, served with `runner: onnxruntime` (which runs a PyTorch file as its ONNX export).
The next runner, PyTorch on the CPU, takes the model with a warning; the config and the metrics say which
runner runs it and why; `strict_runner` (the config's, or the service's) makes the load fail instead, naming
the operator, while the service goes on serving its other models.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from pipeline.tools.testing import serving_stages
from services.model.backend import ModelBackend
from tests.conftest import inference_stub, rpc_error, wait_serving
from tests.integration.test_model_service import infer, model_config
from tests.model_files import KINDS, add_model, reference

CHOLESKY_CONFIG = """
name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ {{ name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4, 4 ] }} ]
parameters [ {{ key: "runner", value: {{ string_value: "onnxruntime" }} }}{extra} ]
"""
STRICT = ', { key: "strict_runner", value: { string_value: "%s" } }'

X = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)


def write_cholesky(path: Path) -> Path:
    """Y = cholesky(x xᵀ + I) of each row x: an operator PyTorch runs and its ONNX exporter refuses."""
    import torch

    def factor(x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.cholesky(x.unsqueeze(2) * x.unsqueeze(1) + torch.eye(x.shape[1]))

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.trace(factor, torch.zeros(2, 4)).save(str(path))
    return path


def add_cholesky(root: Path, name: str, extra: str = "") -> None:
    (root / name).mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(CHOLESKY_CONFIG.format(name=name, extra=extra))
    write_cholesky(root / name / "1" / "model.pt")


def expected(x: np.ndarray) -> np.ndarray:
    return np.linalg.cholesky(x[:, :, None] * x[:, None, :] + np.eye(4, dtype=np.float32))


@contextlib.asynccontextmanager
async def serving(root: Path, metrics: Metrics | None = None, **settings) -> AsyncIterator:
    backend = ModelBackend(Runners(device="cpu", **settings))
    async with serving_stages(
        [],
        repository=ModelRepository(root),
        backends=[backend],
        options={"model_control_mode": "explicit"},
        metrics=metrics,
        metrics_port=0 if metrics else None,
    ) as stage:
        await wait_serving(stage.address, timeout=120)
        async with inference_stub(stage.address) as stub:
            yield stub


def _scrape(metrics: Metrics) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10) as reply:
        return reply.read().decode()


async def load(stub, name: str) -> None:
    await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=name), timeout=120)


async def test_an_operator_the_first_runner_rejects_falls_back_to_the_next(tmp_path: Path, caplog) -> None:
    add_cholesky(tmp_path, "cholesky")
    metrics = Metrics()
    async with serving(tmp_path, metrics) as stub:
        await load(stub, "cholesky")
        config = await model_config(stub, "cholesky")
        assert config.parameters["runner"].string_value == "onnxruntime"  # what was asked for stays
        assert config.parameters["runner_in_use"].string_value == "torch on cpu"
        reason = config.parameters["runner_reason"].string_value
        assert "onnxruntime on cpu failed" in reason and "aten::linalg_cholesky" in reason, reason
        _, outputs = await infer(stub, "cholesky", INPUT__0=X)
        np.testing.assert_allclose(outputs["OUTPUT__0"], expected(X), rtol=1e-5, atol=1e-5)
        # Scraped off the event loop, which serves the model statistics the page includes.
        scraped = await asyncio.to_thread(_scrape, metrics)
        assert (
            'pipeline_model_instances{device="cpu",model="cholesky",runner="torch",version="1"} 1.0'
            in scraped
        ), scraped
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        "onnxruntime on cpu cannot load it" in w and "falling back to torch on cpu" in w for w in warnings
    )


async def test_the_preferred_runner_keeps_the_model_when_it_loads(tmp_path: Path) -> None:
    _, template, _, _ = KINDS["torchscript"]
    pinned = (
        template.format(name="linear")
        + 'parameters [ { key: "runner", value: { string_value: "onnxruntime" } } ]'
    )
    folder = add_model(tmp_path, "torchscript", "linear", {"1": 4}, config=pinned)
    async with serving(tmp_path) as stub:
        await load(stub, "linear")
        config = await model_config(stub, "linear")
        assert config.parameters["runner_in_use"].string_value == "onnxruntime on cpu"
        _, outputs = await infer(stub, "linear", INPUT__0=X)
        want = reference(folder / "1" / "model.pt", {"input": X})["OUTPUT__0"]
        np.testing.assert_allclose(outputs["OUTPUT__0"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["config", "service"])
async def test_strict_fails_the_load_naming_why_and_the_rest_serves(tmp_path: Path, where: str) -> None:
    add_cholesky(tmp_path, "cholesky", STRICT % "true" if where == "config" else "")
    add_cholesky(tmp_path, "lenient", STRICT % "false")  # the config's word beats the service's
    async with serving(tmp_path, strict_runner=where == "service") as stub:
        error = await rpc_error(
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="cholesky"))
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot export it to ONNX" in error.details() and "linalg_cholesky" in error.details()
        await load(stub, "lenient")
        _, outputs = await infer(stub, "lenient", INPUT__0=X)
        np.testing.assert_allclose(outputs["OUTPUT__0"], expected(X), rtol=1e-5, atol=1e-5)

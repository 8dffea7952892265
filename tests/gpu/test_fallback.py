"""The runner fallback on a GPU, for real: TensorRT cannot build an engine from a model whose operator its ONNX
export refuses (`aten::linalg_cholesky`), and the next runner, torch on the same GPU, takes the model; strict,
the load fails naming why. Skipped, saying what is missing, where TensorRT cannot run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.protocol.errors import RepositoryError
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from services.model.backend import ModelBackend
from services.model.tensorrt import tensorrt_status
from tests.integration.test_runner_fallback import expected, write_cholesky

pytestmark = pytest.mark.gpu

TRT_USABLE, TRT_WHY = tensorrt_status()
needs_trt = pytest.mark.skipif(not TRT_USABLE, reason=f"needs TensorRT on a GPU: {TRT_WHY}")

CONFIG = """
name: "cholesky"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4, 4 ] } ]
instance_group [ { kind: KIND_GPU, gpus: [ 0 ] } ]
"""


def repository(tmp_path: Path) -> ModelRepository:
    (tmp_path / "cholesky").mkdir()
    (tmp_path / "cholesky" / "config.pbtxt").write_text(CONFIG)
    write_cholesky(tmp_path / "cholesky" / "1" / "model.pt")
    return ModelRepository(tmp_path)


@needs_trt
def test_tensorrt_fails_on_the_operator_and_torch_on_the_gpu_takes_the_model(tmp_path: Path) -> None:
    entry = repository(tmp_path).read("cholesky")
    backend = ModelBackend(Runners(engine_cache=tmp_path / ".engines"))
    prepared = backend.prepare(entry, "1")
    (instance,) = prepared.instances
    assert instance.reason.startswith("tensorrt on cuda:0")
    instance.load()
    try:
        assert (instance.runner, instance.device) == ("torch", "cuda:0")
        assert "tensorrt on cuda:0 failed" in instance.reason and "linalg_cholesky" in instance.reason
        assert prepared.config.parameters["runner_in_use"].string_value == "torch on cuda:0"
        x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
        np.testing.assert_allclose(
            instance.run({"INPUT__0": x})["OUTPUT__0"], expected(x), rtol=1e-4, atol=1e-4
        )
    finally:
        instance.unload()


@needs_trt
def test_strict_fails_where_tensorrt_fails(tmp_path: Path) -> None:
    entry = repository(tmp_path).read("cholesky")
    backend = ModelBackend(Runners(engine_cache=tmp_path / ".engines", strict_runner=True))
    (instance,) = backend.prepare(entry, "1").instances
    with pytest.raises(RepositoryError, match="linalg_cholesky"):
        instance.load()

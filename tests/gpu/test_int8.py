"""TensorRT runs the INT8 version `pipeline quantize` writes (a QDQ graph: an explicitly quantized network) on
the GPU, agreeing with FP32 on the CPU as ONNX Runtime's INT8 does. Skipped, saying what is missing, where
TensorRT cannot run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from services.model.backend import ModelBackend
from services.model.quantize import QuantizeSettings, quantize
from services.model.tensorrt import tensorrt_status

pytestmark = pytest.mark.gpu

TRT_USABLE, TRT_WHY = tensorrt_status()


@pytest.mark.skipif(not TRT_USABLE, reason=f"needs TensorRT on a GPU: {TRT_WHY}")
def test_tensorrt_runs_the_int8_version_and_agrees_with_fp32(tmp_path: Path) -> None:
    from examples.models.build import build

    build(tmp_path, ["refcnn_cnn"], progress=False, report=lambda _: None)
    images = np.random.default_rng(0).standard_normal((128, 3, 64, 64)).astype(np.float32)
    np.save(tmp_path / "calibration.npy", images[:64])
    report = quantize(tmp_path, "refcnn_cnn", QuantizeSettings(calibration=tmp_path / "calibration.npy"))
    entry = ModelRepository(tmp_path).read("refcnn_cnn")

    def logits(device: str, version: str) -> tuple[np.ndarray, str]:
        settings = Runners(device=device, engine_cache=tmp_path / ".engines", strict_runner=True)
        (instance,) = ModelBackend(settings).prepare(entry, version).instances
        instance.load()
        try:
            out = [instance.run({"INPUT": images[i : i + 16]})["LOGITS"] for i in range(64, 128, 16)]
            return np.concatenate(out), instance.runner
        finally:
            instance.unload()

    fp32, _ = logits("cpu", "1")
    int8_cpu, _ = logits("cpu", report.version)
    int8_trt, runner = logits("cuda:0", report.version)
    assert runner == "tensorrt"
    agreement = float(np.mean(int8_trt.argmax(1) == fp32.argmax(1)))
    assert agreement >= 0.99, agreement
    scale = float(np.max(np.abs(fp32)))
    assert np.max(np.abs(int8_trt - fp32)) <= 2 * max(np.max(np.abs(int8_cpu - fp32)), 0.01 * scale)

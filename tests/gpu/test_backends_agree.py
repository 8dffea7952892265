"""The same weights give the same answers on every backend (TensorRT, torch CUDA, torch CPU), FP32 and FP16.

Runs for real on a GPU machine (`scripts/gpu-check.sh`); here it is skipped, saying what is missing.
Tolerances (absolute and relative, on the outputs): FP32 1e-3 for the CNNs and 2e-3 for MiniLM (TF32 and
kernel choice differ between cuDNN, TensorRT and the CPU); FP16 3e-2 for the CNNs and 5e-2 for MiniLM (half
precision keeps ~3 decimal digits through several layers). The digits' labels must agree exactly at FP32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from services.model.backends import TorchRunner, tensorrt_status
from services.model.digits import train
from services.model.networks import network

pytestmark = pytest.mark.gpu

HAS_CUDA = torch.cuda.is_available()
TRT_USABLE, TRT_WHY = tensorrt_status()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
needs_trt = pytest.mark.skipif(not TRT_USABLE, reason=f"needs TensorRT on a GPU: {TRT_WHY}")

TOLERANCE = {
    ("digits_cnn", "fp32"): 1e-3,
    ("refcnn", "fp32"): 1e-3,
    ("minilm", "fp32"): 2e-3,
    ("digits_cnn", "fp16"): 3e-2,
    ("refcnn", "fp16"): 3e-2,
    ("minilm", "fp16"): 5e-2,
}
MODELS = ("digits_cnn", "refcnn", "minilm")


@pytest.fixture(scope="module")
def version_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | None]:
    root = tmp_path_factory.mktemp("models")
    train(root, epochs=5, progress=False)
    return {"digits_cnn": root / "digits_cnn" / "1", "refcnn": None, "minilm": None}


def reference(model: str, version_dir: Path | None, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Torch on the CPU at FP32: the answer every backend is held to."""
    runner = TorchRunner(network(model), version_dir, device="cpu")
    runner.load()
    return next(iter(runner.run(inputs).values()))


def compare(model: str, precision: str, got: np.ndarray, want: np.ndarray) -> None:
    tolerance = TOLERANCE[(model, precision)]
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    if model == "digits_cnn" and precision == "fp32":
        np.testing.assert_array_equal(got.argmax(1), want.argmax(1))


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("model", MODELS)
def test_torch_cuda_matches_cpu(model: str, precision: str, version_dirs, tmp_path: Path) -> None:
    net = network(model)
    inputs = net.example(16)
    runner = TorchRunner(net, version_dirs[model], device="cuda:0", precision=precision)
    runner.load()
    compare(
        model,
        precision,
        next(iter(runner.run(inputs).values())),
        reference(model, version_dirs[model], inputs),
    )


@needs_cuda
@pytest.mark.parametrize("model", ["digits_cnn", "refcnn"])
def test_cuda_graphs_match_eager(model: str, version_dirs) -> None:
    from services.model.backends import TorchOptions

    net = network(model)
    eager = TorchRunner(net, version_dirs[model], device="cuda:0")
    graphs = TorchRunner(net, version_dirs[model], device="cuda:0", options=TorchOptions(cuda_graphs=True))
    eager.load(), graphs.load()
    for batch in (1, 8, 8, 32):  # the second 8 replays the captured graph
        inputs = net.example(batch)
        np.testing.assert_allclose(
            graphs.run(inputs)["LOGITS"], eager.run(inputs)["LOGITS"], rtol=1e-4, atol=1e-4
        )


@needs_trt
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("model", MODELS)
def test_tensorrt_matches_cpu(model: str, precision: str, version_dirs, tmp_path: Path) -> None:
    from services.model.tensorrt import TensorRTRunner

    net = network(model)
    runner = TensorRTRunner(
        net, version_dirs[model], device="cuda:0", precision=precision, cache_dir=tmp_path
    )
    runner.load()
    assert runner.built and runner.engine_path is not None and runner.engine_path.is_file()
    for batch in (1, 7, 32):  # inside the profile, not only at its opt
        inputs = net.example(batch)
        got = next(iter(runner.run(inputs).values()))
        compare(model, precision, got, reference(model, version_dirs[model], inputs))
    runner.unload()
    # Same weights, TensorRT, GPU and profile: the second load reads the cached engine and builds nothing.
    again = TensorRTRunner(net, version_dirs[model], device="cuda:0", precision=precision, cache_dir=tmp_path)
    again.load()
    assert not again.built and again.engine_path == runner.engine_path
    again.unload()


@needs_trt
def test_tensorrt_rebuilds_when_the_profile_changes(version_dirs, tmp_path: Path) -> None:
    from services.model.tensorrt import TensorRTRunner

    net = network("digits_cnn")
    first = TensorRTRunner(net, version_dirs["digits_cnn"], cache_dir=tmp_path, max_batch_size=64)
    first.load()
    other = TensorRTRunner(net, version_dirs["digits_cnn"], cache_dir=tmp_path, max_batch_size=128)
    other.load()
    assert first.built and other.built and first.engine_path != other.engine_path


@needs_trt
def test_auto_chooses_tensorrt_on_a_gpu() -> None:
    from services.model.backends import resolve_backend

    assert resolve_backend("auto", "cuda:0")[0] == "tensorrt"

"""The same model file gives the same answers on every runner (TensorRT, torch on CUDA, ONNX Runtime's CUDA
provider) as on the CPU, at FP32 and FP16, through `ModelBackend` as the model service runs it.

Runs for real on a GPU machine (`scripts/gpu-check.sh`); elsewhere each test is skipped, saying what is
missing. Tolerances (absolute and relative, on the outputs): FP32 1e-3 for the CNNs and 2e-3 for MiniLM (TF32
and kernel choice differ between cuDNN, TensorRT and the CPU); FP16 3e-2 for the CNNs and 5e-2 for MiniLM (half
precision keeps ~3 decimal digits through several layers). The digits' labels must agree exactly at FP32.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from services.model.backend import ModelBackend
from services.model.tensorrt import tensorrt_status

pytestmark = pytest.mark.gpu

HAS_CUDA = torch.cuda.is_available()
TRT_USABLE, TRT_WHY = tensorrt_status()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
needs_trt = pytest.mark.skipif(not TRT_USABLE, reason=f"needs TensorRT on a GPU: {TRT_WHY}")

TOLERANCE = {"fp32": {"minilm_encoder": 2e-3}, "fp16": {"minilm_encoder": 5e-2}}
DEFAULT_TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2}
MODELS = ("digits_cnn", "refcnn_cnn", "minilm_encoder")
TENSORRT_FP16 = (
    'optimization { execution_accelerators { gpu_execution_accelerator: [ { name: "tensorrt" '
    'parameters { key: "precision_mode" value: "FP16" } } ] } }\n'
)
TORCH_FP16 = 'optimization { execution_accelerators { gpu_execution_accelerator: [ { name: "auto_mixed_precision" } ] } }\n'


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.models.build import build

    root = tmp_path_factory.mktemp("models")
    build(root, progress=False, report=lambda _: None)
    return root


def inputs_for(model: str, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    if model == "digits_cnn":
        return {"INPUT": rng.uniform(0, 16, size=(batch, 1, 8, 8)).astype(np.float32)}
    if model == "refcnn_cnn":
        return {"INPUT": rng.standard_normal((batch, 3, 64, 64)).astype(np.float32)}
    ids = rng.integers(1000, 30000, size=(batch, 16)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[-1, 8:] = 0
    return {"INPUT_IDS": ids, "ATTENTION_MASK": mask}


def run(
    root: Path, model: str, inputs: dict[str, np.ndarray], *, device: str, extra: str = "", runner: str = ""
):
    """Prepare, load and run one instance of `model` on `device`, with `extra` added to its config."""
    config = (root / model / "config.pbtxt").read_text() + extra
    if runner:
        config += f'parameters [ {{ key: "runner" value: {{ string_value: "{runner}" }} }} ]\n'
    folder = root.parent / f"{root.name}-{model}-{device.replace(':', '')}-{abs(hash(config))}"
    if not folder.exists():
        (folder / model).mkdir(parents=True)
        (folder / model / "config.pbtxt").write_text(config)
        # Hard links: a symbolic link out of the repository would be refused.
        shutil.copytree(root / model / "1", folder / model / "1", copy_function=os.link)
    backend = ModelBackend(Runners(device=device, engine_cache=root.parent / "engines"))
    prepared = backend.prepare(ModelRepository(folder).read(model), "1")
    instance = prepared.instances[0]
    instance.load()
    try:
        return instance.run(inputs), instance.reason
    finally:
        instance.unload()


def compare(model: str, precision: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    tolerance = TOLERANCE[precision].get(model, DEFAULT_TOLERANCE[precision])
    for name, expected in want.items():
        np.testing.assert_allclose(got[name].astype(np.float32), expected, rtol=tolerance, atol=tolerance)
    if model == "digits_cnn" and precision == "fp32":
        np.testing.assert_array_equal(got["LOGITS"].argmax(1), want["LOGITS"].argmax(1))


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("model", MODELS)
def test_cuda_matches_the_cpu(examples: Path, model: str, precision: str) -> None:
    """torch on CUDA (FP16: autocast) for the PyTorch files, ONNX Runtime's CUDA provider for ONNX."""
    inputs = inputs_for(model, 8)
    want, _ = run(examples, model, inputs, device="cpu")
    extra = TORCH_FP16 if precision == "fp16" else ""
    runner = "" if model == "refcnn_cnn" else "torch"
    if model == "refcnn_cnn" and precision == "fp16":
        pytest.skip("ONNX Runtime runs the file's own precision (FP32); FP16 of an ONNX file is TensorRT's")
    got, reason = run(examples, model, inputs, device="cuda:0", extra=extra, runner=runner or "onnxruntime")
    assert "cuda:0" in reason or "no CUDA provider" in reason, reason
    compare(model, precision, got, want)


@needs_trt
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("model", MODELS)
def test_tensorrt_matches_the_cpu(examples: Path, model: str, precision: str) -> None:
    """ONNX → TensorRT for refcnn, PyTorch → ONNX → TensorRT for the others, cached."""
    inputs = inputs_for(model, 8)
    want, _ = run(examples, model, inputs, device="cpu")
    extra = TENSORRT_FP16 if precision == "fp16" else ""
    got, reason = run(examples, model, inputs, device="cuda:0", extra=extra, runner="tensorrt")
    assert reason.startswith("tensorrt on cuda:0"), reason
    compare(model, precision, got, want)
    engines = list((examples.parent / "engines").glob(f"{model}/*.plan"))
    assert engines, "the built engine is cached"


@needs_trt
def test_a_plan_file_is_served_as_it_is(examples: Path, tmp_path: Path) -> None:
    """A `.plan` from the engine cache, dropped into a repository as `model.plan` with no config."""
    inputs = inputs_for("refcnn_cnn", 4)
    want, _ = run(examples, "refcnn_cnn", inputs, device="cpu")
    run(examples, "refcnn_cnn", inputs, device="cuda:0", runner="tensorrt")
    (engine,) = sorted((examples.parent / "engines").glob("refcnn_cnn/*.plan"))[:1]
    (tmp_path / "engine" / "1").mkdir(parents=True)
    (tmp_path / "engine" / "1" / "model.plan").write_bytes(engine.read_bytes())
    prepared = ModelBackend(Runners(device="cuda:0")).prepare(ModelRepository(tmp_path).read("engine"), "1")
    assert [t.name for t in prepared.config.input] == ["INPUT"]
    instance = prepared.instances[0]
    instance.load()
    compare("refcnn_cnn", "fp32", instance.run(inputs), want)


@needs_cuda
def test_auto_takes_tensorrt_where_it_runs_and_says_why_not_elsewhere(examples: Path) -> None:
    _, reason = run(examples, "refcnn_cnn", inputs_for("refcnn_cnn", 1), device="cuda:0")
    if TRT_USABLE:
        assert reason.startswith("tensorrt on cuda:0 at fp32: auto"), reason
    else:
        assert "TensorRT is not usable" in reason, reason

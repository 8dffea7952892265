"""Backend choice, the TensorRT engine cache keys, ONNX export, the torch runner's modes and instance placement.

This machine has neither CUDA nor TensorRT: where a test needs them to be present it replaces
`torch.cuda.is_available` / `backends.tensorrt_status` (and says so); tests/gpu runs the real thing.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from services.model import backends
from services.model.backends import (
    BackendUnavailable,
    TorchOptions,
    TorchRunner,
    resolve_backend,
    select_runner,
)
from services.model.digits import train
from services.model.networks import NETWORKS, module_digest, network
from services.model.repository import InstanceGroup, RepositoryError, place_instances
from services.model.tensorrt import EngineCache, EngineKey, export_onnx, optimization_profile


@pytest.fixture(scope="module")
def digits_version(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    train(root, epochs=2, progress=False)
    return root / "digits_cnn" / "1"


# ---- backend selection ------------------------------------------------------------------------------------


def test_auto_falls_back_to_torch_without_tensorrt(monkeypatch: pytest.MonkeyPatch) -> None:
    # Mocked: this machine has no TensorRT; a GPU instance with TensorRT missing falls back and says why.
    monkeypatch.setattr(backends, "tensorrt_status", lambda: (False, "the tensorrt package is not installed"))
    backend, why = resolve_backend("auto", "cuda:0")
    assert backend == "torch" and "tensorrt package is not installed" in why and "falling back" in why
    with pytest.raises(BackendUnavailable, match="tensorrt package is not installed"):
        resolve_backend("tensorrt", "cuda:0")


def test_auto_picks_tensorrt_when_it_imports_and_a_gpu_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    # Mocked: plays a GPU machine with TensorRT.
    monkeypatch.setattr(
        backends, "tensorrt_status", lambda: (True, "TensorRT 11.4 and a CUDA GPU are present")
    )
    assert resolve_backend("auto", "cuda:1") == ("tensorrt", "auto: TensorRT 11.4 and a CUDA GPU are present")
    assert resolve_backend("tensorrt", "cuda:0")[0] == "tensorrt"
    assert resolve_backend("torch", "cuda:0") == ("torch", "torch requested")


def test_cpu_instances_run_torch_and_refuse_tensorrt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "tensorrt_status", lambda: (True, "present"))
    backend, why = resolve_backend("auto", "cpu")
    assert backend == "torch" and "CPU" in why
    with pytest.raises(BackendUnavailable, match="needs a GPU instance"):
        resolve_backend("tensorrt", "cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("onnx", "cpu")


def test_real_tensorrt_status_here_says_what_is_missing() -> None:
    usable, why = backends.tensorrt_status()
    if usable:
        pytest.skip("this machine has TensorRT and a GPU")
    assert "not installed" in why or "no CUDA GPU" in why or "does not import" in why


def test_select_runner_logs_the_choice(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    monkeypatch.setattr(backends, "tensorrt_status", lambda: (False, "no tensorrt here"))
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        runner = select_runner(
            "auto", "cpu", network=network("refcnn"), version_dir=None, label="refcnn_cnn:1"
        )
    assert isinstance(runner, TorchRunner) and runner.device == "cpu"
    assert "refcnn_cnn:1: backend torch on cpu at fp32" in caplog.text
    with pytest.raises(ValueError, match="precision"):
        select_runner("torch", "cpu", network=network("refcnn"), version_dir=None, precision="int4")


# ---- torch runner -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "script", "export"])
def test_torch_modes_agree(mode: str, digits_version: Path) -> None:
    net = network("digits_cnn")
    batch = net.example(5)
    eager = TorchRunner(net, digits_version)
    eager.load()
    other = TorchRunner(net, digits_version, options=TorchOptions(mode=mode))
    other.load()
    np.testing.assert_allclose(other.run(batch)["LOGITS"], eager.run(batch)["LOGITS"], rtol=1e-5, atol=1e-5)
    # Any batch size (the export is dynamic in the batch).
    assert other.run(net.example(17))["LOGITS"].shape == (17, 10)


def test_fp16_on_cpu_stays_close_to_fp32(digits_version: Path) -> None:
    net = network("digits_cnn")
    batch = net.example(8)
    full, half = TorchRunner(net, digits_version), TorchRunner(net, digits_version, precision="fp16")
    full.load(), half.load()
    out = half.run(batch)["LOGITS"]
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, full.run(batch)["LOGITS"], rtol=2e-2, atol=5e-2)


def test_torch_options_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown torch mode"):
        TorchOptions(mode="fast")


# ---- TensorRT engine cache (no TensorRT needed) ------------------------------------------------------------


def _key(**changes: object) -> EngineKey:
    parts: dict = {
        "model": "digits_cnn",
        "model_hash": "abc",
        "precision": "fp16",
        "tensorrt": "11.4.0",
        "gpu": "NVIDIA H100",
        "profile": optimization_profile(network("digits_cnn"), 256, 32),
    }
    parts.update(changes)
    return EngineKey.of(**parts)


def test_engine_key_changes_with_each_of_its_parts() -> None:
    base = _key()
    assert _key().digest == base.digest  # stable
    others = [
        _key(model_hash="abd"),
        _key(tensorrt="11.5.0"),
        _key(gpu="NVIDIA H200"),
        _key(precision="fp32"),
        _key(profile=optimization_profile(network("digits_cnn"), 128, 32)),
        _key(profile=optimization_profile(network("digits_cnn"), 256, 8)),
    ]
    assert len({k.digest for k in others} | {base.digest}) == len(others) + 1


def test_profile_spans_one_to_max_batch_with_opt_at_the_preferred() -> None:
    assert optimization_profile(network("digits_cnn"), 256, 32) == {
        "INPUT": ((1, 1, 8, 8), (32, 1, 8, 8), (256, 1, 8, 8))
    }
    assert optimization_profile(network("refcnn"), 64, None)["INPUT"][1] == (64, 3, 64, 64)
    minilm = optimization_profile(network("minilm"), 128, 16)
    assert minilm["INPUT_IDS"] == ((1, 1), (16, 128), (128, 512)) == minilm["ATTENTION_MASK"]


def test_engine_cache_lookup_store_and_invalidation(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    key = _key()
    assert cache.lookup(key) is None
    path = cache.store(key, b"plan bytes")
    assert path.parent == tmp_path / "digits_cnn" and path.with_suffix(".json").is_file()
    assert cache.lookup(key) == b"plan bytes"
    # A new TensorRT, another GPU or new weights: a miss, so the engine is rebuilt; the old one stays.
    for other in (_key(tensorrt="12.0"), _key(gpu="NVIDIA L4"), _key(model_hash="new")):
        assert cache.lookup(other) is None
    assert cache.entries("digits_cnn") == [path]
    assert not list(tmp_path.rglob(".partial-*"))


def test_model_digest_follows_the_weights() -> None:
    a, b = network("refcnn").build(None), network("refcnn").build(None)
    assert module_digest(a, "fp32") == module_digest(b, "fp32")
    assert module_digest(a, "fp32") != module_digest(a, "fp16")
    with torch.no_grad():
        b[0].bias[0] += 1
    assert module_digest(a, "fp32") != module_digest(b, "fp32")


# ---- ONNX export (CPU) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_onnx_export_has_a_dynamic_batch(precision: str, digits_version: Path, tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx", reason="ONNX export needs the onnx package")
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    net = network("digits_cnn")
    module = net.build(digits_version)
    if precision == "fp16":
        module = module.half()
    path = export_onnx(module, net, tmp_path / "digits.onnx", precision=precision)
    graph = onnx.load(str(path)).graph
    (inp,), (out,) = graph.input, graph.output
    assert inp.name == "INPUT" and out.name == "LOGITS"
    dims = inp.type.tensor_type.shape.dim
    assert dims[0].dim_param and not dims[0].dim_value  # symbolic: dynamic batch
    assert [d.dim_value for d in dims[1:]] == [1, 8, 8]
    assert out.type.tensor_type.shape.dim[0].dim_param == dims[0].dim_param
    expected = onnx.TensorProto.FLOAT16 if precision == "fp16" else onnx.TensorProto.FLOAT
    assert inp.type.tensor_type.elem_type == expected
    ort = pytest.importorskip("onnxruntime", reason="optional: onnxruntime checks the exported answers")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    images = net.example(7)["INPUT"]
    feed = images.astype(np.float16) if precision == "fp16" else images
    got = session.run(None, {"INPUT": feed})[0].astype(np.float32)
    with torch.inference_mode():
        want = net.build(digits_version)(torch.from_numpy(images)).numpy()
    tolerance = 5e-2 if precision == "fp16" else 1e-4
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


# ---- instance placement -----------------------------------------------------------------------------------


def test_instances_round_robin_over_visible_gpus() -> None:
    assert place_instances([InstanceGroup(count=3, kind="gpu")], gpu_count=2) == [
        "cuda:0",
        "cuda:1",
        "cuda:0",
    ]


def test_named_gpus_get_count_instances_each() -> None:
    groups = [InstanceGroup(count=2, kind="gpu", gpus=[1]), InstanceGroup(count=1, kind="cpu")]
    assert place_instances(groups, gpu_count=2) == ["cuda:1", "cuda:1", "cpu"]
    assert place_instances([InstanceGroup(count=1, kind="gpu", gpus=[0, 1])], gpu_count=2) == [
        "cuda:0",
        "cuda:1",
    ]


def test_default_placement_follows_the_device_setting() -> None:
    assert place_instances([], gpu_count=0) == ["cpu"]
    assert place_instances([], gpu_count=2) == ["cuda:0"]
    assert place_instances([], gpu_count=2, default_device="cpu") == ["cpu"]
    assert place_instances([InstanceGroup(count=2)], gpu_count=2, default_device="cuda:1") == ["cuda:1"] * 2


def test_impossible_placements_are_refused() -> None:
    with pytest.raises(RepositoryError, match="no CUDA GPU is visible"):
        place_instances([InstanceGroup(kind="gpu")], gpu_count=0)
    with pytest.raises(RepositoryError, match=r"names GPU\(s\) \[3\]"):
        place_instances([InstanceGroup(kind="gpu", gpus=[3])], gpu_count=2)
    with pytest.raises(ValueError, match="kind is cpu"):
        InstanceGroup(kind="cpu", gpus=[0])


def test_every_network_has_what_the_backends_need() -> None:
    for net in NETWORKS.values():
        example = net.example(3)
        assert set(example) == {s.name for s in net.inputs}
        assert all(a.shape[0] == 3 for a in example.values())
        optimization_profile(net, net.max_batch_size, None)

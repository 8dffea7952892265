"""`digits_cnn`: the split, deterministic training, safe loading, backend choice, and the whole chain in-process."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from services.model import backends
from services.model.backends import (
    BackendUnavailable,
    ModelBackend,
    ModelLoadError,
    TorchBackend,
    select_backend,
    sha256_file,
)
from services.model.digits import DEFAULT_EPOCHS, DigitsCNN, TrainReport, load_split, model_dir_weights, train
from services.model.stage import DigitsCNNStage
from services.model.train import main as train_main
from tests.stages import example_stage


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> TrainReport:
    """The production recipe (default epochs and seed), trained once for this module."""
    return train(tmp_path_factory.mktemp("models"), epochs=DEFAULT_EPOCHS, seed=0, progress=False)


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_split_is_fixed_stratified_and_in_raw_units() -> None:
    x_train, y_train, x_test, y_test = load_split()
    assert x_train.shape == (1437, 1, 8, 8) and x_test.shape == (360, 1, 8, 8)
    assert x_train.dtype == x_test.dtype == np.float32
    assert y_train.dtype == y_test.dtype == np.int64
    assert x_train.min() == 0.0 and x_train.max() == 16.0
    # Stratified: every class holds about a fifth of its images out.
    share = np.bincount(y_test, minlength=10) / (np.bincount(y_train, minlength=10) + np.bincount(y_test))
    assert np.all(np.abs(share - 0.2) < 0.01)
    again = load_split()
    for a, b in zip((x_train, y_train, x_test, y_test), again, strict=True):
        np.testing.assert_array_equal(a, b)
    x_test[0] = -1  # callers get their own copies
    assert load_split()[2][0].min() == 0.0


def test_training_is_deterministic(tmp_path: Path) -> None:
    first = train(tmp_path / "a", epochs=2, seed=7, progress=False)
    second = train(tmp_path / "b", epochs=2, seed=7, progress=False)
    other = train(tmp_path / "c", epochs=2, seed=8, progress=False)
    assert first.weights == model_dir_weights(tmp_path / "a")
    assert first.sha256 == second.sha256
    assert first.weights.read_bytes() == second.weights.read_bytes()
    a = torch.load(first.weights, weights_only=True)
    c = torch.load(other.weights, weights_only=True)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_training_leaves_global_torch_state_alone(tmp_path: Path, restore_threads: None) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    train(tmp_path, epochs=1, progress=False)
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == 2
    assert not torch.are_deterministic_algorithms_enabled()


def test_trained_model_and_metadata(trained: TrainReport) -> None:
    assert trained.test_accuracy >= 0.97
    assert trained.seconds < 30
    metadata = json.loads((trained.weights.parent / "metadata.json").read_text())
    assert metadata["sha256"] == sha256_file(trained.weights) == trained.sha256
    assert metadata["test_accuracy"] == trained.test_accuracy
    assert metadata["seed"] == 0
    assert metadata["split"]["test"] == 360


def _png(digit: np.ndarray, *, size: int, dark_ink: bool, mode: str) -> bytes:
    grey = np.rint(digit * (255.0 / 16.0)).astype(np.uint8)
    if dark_ink:
        grey = 255 - grey
    image = Image.fromarray(grey, "L").resize((size, size), Image.Resampling.NEAREST).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _jpeg(digit: np.ndarray) -> bytes:
    grey = np.rint(digit * (255.0 / 16.0)).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(grey, "L").resize((56, 56), Image.Resampling.BILINEAR).convert("RGB").save(buffer, "JPEG")
    return buffer.getvalue()


def test_whole_chain_in_process_on_held_out_images(trained: TrainReport) -> None:
    _, _, x_test, y_test = load_split()
    images = np.empty((len(x_test), 1), dtype=object)
    for i, digit in enumerate(x_test[:, 0]):
        variant = i % 4
        if variant == 3:
            images[i, 0] = _jpeg(digit)
        else:
            images[i, 0] = _png(
                digit, size=(8, 32, 100)[variant], dark_ink=i % 2 == 0, mode=("L", "RGB")[i % 2]
            )
    preprocess, postprocess = example_stage("digits_preprocess"), example_stage("digits_postprocess")
    model = DigitsCNNStage(trained.weights.parents[2], device="cpu")
    model.load()
    labels = []
    for start in range(0, len(images), preprocess.max_batch_size):
        pixels = preprocess.infer({"IMAGE": images[start : start + preprocess.max_batch_size]})["PIXELS"]
        logits = model.infer({"INPUT": pixels})["LOGITS"]
        assert logits.dtype == np.float32 and logits.shape == (len(pixels), 10)
        labels.append(postprocess.infer({"LOGITS": logits})["LABEL"][:, 0])
    accuracy = float(np.mean(np.concatenate(labels) == y_test))
    assert accuracy >= 0.95, accuracy


# backends.py silences this warning when it is imported, but pytest restores the filters after collection.
@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable:UserWarning")
def test_stage_runs_read_only_request_views(trained: TrainReport) -> None:
    x_test = load_split()[2][:16]
    stage = DigitsCNNStage(trained.weights.parents[2], device="cpu")
    stage.load()
    view = np.frombuffer(x_test.tobytes(), dtype=np.float32).reshape(x_test.shape)  # as the runtime decodes
    assert not view.flags.writeable
    np.testing.assert_array_equal(
        stage.infer({"INPUT": view})["LOGITS"], stage.infer({"INPUT": x_test})["LOGITS"]
    )
    stage.unload()


def test_stage_declaration(tmp_path: Path) -> None:
    stage = DigitsCNNStage(tmp_path, backend="torch", device="cpu")
    assert stage.name == "digits_cnn"
    assert stage.max_batch_size == 256
    assert stage.platform == "pytorch_libtorch" and stage.backend == "pytorch"
    assert [(t.name, t.datatype, t.shape) for t in stage.inputs] == [("INPUT", "FP32", (-1, 1, 8, 8))]
    assert [(t.name, t.datatype, t.shape) for t in stage.outputs] == [("LOGITS", "FP32", (-1, 10))]
    assert isinstance(stage.runner, ModelBackend)


def test_missing_weights_say_where_and_how_to_make_them(tmp_path: Path) -> None:
    stage = DigitsCNNStage(tmp_path, device="cpu")
    with pytest.raises(ModelLoadError) as caught:
        stage.load()
    message = str(caught.value)
    assert str(tmp_path / "digits_cnn" / "1" / "model.pt") in message
    assert "not found" in message and "make model" in message


def _write_weights(model_dir: Path, data: bytes) -> Path:
    path = model_dir_weights(model_dir)
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return path


def _saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class _NotATensor:
    """Stands for arbitrary pickled objects, which `weights_only=True` must refuse to build."""


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "cannot read"),
        (b"this is not a torch archive", "cannot read"),
        (_saved({"weight": _NotATensor()}), "cannot read"),
        (_saved([torch.zeros(1)]), "not a state_dict"),
        (_saved({"weight": torch.zeros(1)}), "do not fit"),
    ],
    ids=["empty", "garbage", "pickled-object", "not-a-dict", "wrong-network"],
)
def test_corrupt_weights_give_a_clear_error(tmp_path: Path, content: bytes, reason: str) -> None:
    path = _write_weights(tmp_path, content)
    with pytest.raises(ModelLoadError) as caught:
        DigitsCNNStage(tmp_path, device="cpu").load()
    message = str(caught.value)
    assert str(path) in message and reason in message and "make model" in message


def test_weights_that_differ_from_their_metadata_are_refused(trained: TrainReport, tmp_path: Path) -> None:
    state = torch.load(trained.weights, weights_only=True)
    state["classifier.2.bias"] += 1.0
    path = _write_weights(tmp_path, _saved(state))
    (path.parent / "metadata.json").write_text((trained.weights.parent / "metadata.json").read_text())
    with pytest.raises(ModelLoadError, match="sha256") as caught:
        DigitsCNNStage(tmp_path, device="cpu").load()
    assert "make model" in str(caught.value)


def test_tensorrt_is_not_in_this_build(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable, match="TensorRT backend is not available in this build"):
        DigitsCNNStage(tmp_path, backend="tensorrt")


def test_unknown_backend_or_device(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend("onnx", build=DigitsCNN, weights=tmp_path / "w.pt")
    with pytest.raises(ValueError, match="unknown device"):
        select_backend("torch", "tpu", build=DigitsCNN, weights=tmp_path / "w.pt")
    with pytest.raises(ValueError, match="threads"):
        select_backend("torch", "cpu", build=DigitsCNN, weights=tmp_path / "w.pt", threads=0)


def test_auto_picks_cpu_without_cuda_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        chosen = select_backend("auto", "auto", build=DigitsCNN, weights=tmp_path / "w.pt")
    assert isinstance(chosen, TorchBackend) and chosen.device == "cpu"
    assert "backend torch" in caplog.text and "no TensorRT backend in this build" in caplog.text
    assert "CUDA is not available" in caplog.text
    assert "CUDA is not available" in chosen.reason  # logged again by load(), once logging is configured
    with pytest.raises(BackendUnavailable, match="CUDA is not available"):
        select_backend("torch", "cuda", build=DigitsCNN, weights=tmp_path / "w.pt")


def test_auto_picks_cuda_when_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends.torch.cuda, "get_device_name", lambda index=0: "Test GPU")
    assert select_backend("auto", "auto", build=DigitsCNN, weights=tmp_path / "w.pt").device == "cuda"
    assert select_backend("torch", "cpu", build=DigitsCNN, weights=tmp_path / "w.pt").device == "cpu"


def test_torch_threads_setting_is_applied(trained: TrainReport, restore_threads: None) -> None:
    DigitsCNNStage(trained.weights.parents[2], device="cpu", torch_threads=1).load()
    assert torch.get_num_threads() == 1


def test_train_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train_main(["--out", str(tmp_path), "--epochs", "1", "--no-progress"])
    printed = capsys.readouterr().out
    assert "held-out accuracy" in printed
    assert str(model_dir_weights(tmp_path)) in printed
    assert model_dir_weights(tmp_path).is_file()

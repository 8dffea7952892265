"""The example models: the digits split, deterministic training, `examples.models.build`, and the digits chain
in-process with the model served the way the model service serves it (`ModelBackend` on the built file)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from examples.models.build import EXAMPLES, build, main, missing
from examples.models.digits import load_split, train
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from services.model.backend import ModelBackend
from tests.stages import example_stage


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


def test_training_is_deterministic() -> None:
    first, _ = train(epochs=2, seed=7, progress=False)
    second, _ = train(epochs=2, seed=7, progress=False)
    other, _ = train(epochs=2, seed=8, progress=False)
    a, b, c = first.state_dict(), second.state_dict(), other.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_training_leaves_global_torch_state_alone(restore_threads: None) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    train(epochs=1, progress=False)
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == 2
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits model as `make model` writes it (default epochs and seed), in a repository of its own."""
    root = tmp_path_factory.mktemp("repository")
    build(root, ["digits_cnn"], progress=False, report=lambda _: None)
    return root


def test_build_writes_the_file_and_copies_the_config(repository: Path, capsys) -> None:
    assert (repository / "digits_cnn" / "config.pbtxt").is_file()
    assert (repository / "digits_cnn" / "1" / "model.pt").is_file()
    assert missing(repository) == []  # only examples whose config is there count
    (repository / "refcnn_cnn").mkdir()
    (repository / "refcnn_cnn" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"')
    assert missing(repository) == ["refcnn_cnn"]
    main(["--model-dir", str(repository), "refcnn_cnn"])
    assert "refcnn_cnn: wrote" in capsys.readouterr().out
    assert missing(repository) == []
    with pytest.raises(SystemExit):
        main(["--model-dir", str(repository), "nope"])
    assert set(EXAMPLES) == {
        "digits_cnn",
        "refcnn_cnn",
        "minilm_encoder",
        "textgen_generate",
        "textgen_state",
    }


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


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable:UserWarning")
def test_whole_chain_in_process_on_held_out_images(repository: Path) -> None:
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
    entry = ModelRepository(repository).read("digits_cnn")
    prepared = ModelBackend(Runners(device="cpu")).prepare(entry, "1")
    (model,) = prepared.instances
    model.load()
    labels = []
    for start in range(0, len(images), preprocess.max_batch_size):
        pixels = preprocess.infer({"IMAGE": images[start : start + preprocess.max_batch_size]})["PIXELS"]
        # As the runtime decodes a request: a read-only view of its bytes.
        view = np.frombuffer(pixels.tobytes(), dtype=np.float32).reshape(pixels.shape)
        logits = model.run({"INPUT": view})["LOGITS"]
        assert logits.dtype == np.float32 and logits.shape == (len(pixels), 10)
        labels.append(postprocess.infer({"LOGITS": logits})["LABEL"][:, 0])
    accuracy = float(np.mean(np.concatenate(labels) == y_test))
    assert accuracy >= 0.95, accuracy

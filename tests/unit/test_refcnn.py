"""The refcnn stages composed in-process give the peers' reference pipeline's results; the model is the ONNX
file `make model` writes, run as the model service runs it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from examples.models.build import build
from examples.models.refcnn import build_refcnn
from pipeline.protocol.errors import InvalidInput
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from pipeline.stage.api import Stage
from services.model.backend import ModelBackend
from tests.stages import example_stage

# The oracle: the reference model that TorchServe, MLServer and Ray Serve serve in the comparison
# benchmarks, written out independently of the stages under test.
_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def _reference_model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.Conv2d(64, 128, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(128, 10),
    )
    m.eval()
    return m


def _reference_pipeline(model: torch.nn.Module, x_uint8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        x = x_uint8.to(torch.float32).div_(255.0)
        logits = model((x - _MEAN) / _STD)
        p, idx = torch.softmax(logits, dim=1).max(dim=1)
        return idx, p


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Stage, object, Stage]:
    root = tmp_path_factory.mktemp("repository")
    build(root, ["refcnn_cnn"], progress=False, report=lambda _: None)
    entry = ModelRepository(root).read("refcnn_cnn")
    (model,) = ModelBackend(Runners(device="cpu")).prepare(entry, "1").instances
    model.load()
    return example_stage("refcnn_preprocess"), model, example_stage("refcnn_postprocess")


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_composed_stages_give_the_reference_results(stages, batch: int) -> None:
    pre, model, post = stages
    images = np.random.default_rng(batch).integers(0, 256, size=(batch, 3, 64, 64), dtype=np.uint8)
    images.flags.writeable = False  # what the runtime hands over: a read-only view of the request bytes

    pixels = pre.infer({"IMAGE": images})["PIXELS"]
    logits = model.run({"INPUT": pixels})["LOGITS"]
    out = post.infer({"LOGITS": logits})

    with torch.random.fork_rng(devices=[]):
        reference = _reference_model()
    idx, p = _reference_pipeline(reference, torch.from_numpy(images.copy()))
    assert pixels.dtype == np.float32 and pixels.shape == (batch, 3, 64, 64)
    assert logits.dtype == np.float32 and logits.shape == (batch, 10)
    assert out["LABEL"].dtype == np.int64 and out["LABEL"].shape == (batch, 1)
    assert out["PROB"].dtype == np.float32 and out["PROB"].shape == (batch, 1)
    # Same operations in the same order: the normalised pixels are bit for bit the reference's; the logits,
    # computed by ONNX Runtime from the exported file, agree to float32 rounding.
    with torch.inference_mode():
        x = torch.from_numpy(images.copy()).to(torch.float32).div_(255.0)
        ref_pixels = ((x - _MEAN) / _STD).numpy()
        ref_logits = reference(torch.from_numpy(ref_pixels)).numpy()
    np.testing.assert_array_equal(pixels, ref_pixels)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out["LABEL"][:, 0], idx.numpy())
    np.testing.assert_allclose(out["PROB"][:, 0], p.numpy(), rtol=1e-5, atol=0)


def test_building_the_network_is_deterministic_and_leaves_the_rng_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first, second = build_refcnn().state_dict(), build_refcnn().state_dict()
    np.testing.assert_array_equal(torch.rand(3).numpy(), expected_next.numpy())
    assert all(torch.equal(first[k], second[k]) for k in first)
    reference = _reference_model().state_dict()
    assert all(torch.equal(first[k], reference[k]) for k in first)


def test_preprocess_does_not_modify_its_input() -> None:
    images = np.full((2, 3, 64, 64), 200, dtype=np.uint8)
    images.flags.writeable = False
    pixels = example_stage("refcnn_preprocess").infer({"IMAGE": images})["PIXELS"]
    assert (images == 200).all()
    np.testing.assert_allclose(
        pixels[0, :, 0, 0], (200 / 255 - np.array([0.485, 0.456, 0.406])) / [0.229, 0.224, 0.225], rtol=1e-6
    )


def test_postprocess_refuses_non_finite_logits_and_survives_huge_ones() -> None:
    post = example_stage("refcnn_postprocess")
    huge = np.array([[1000.0, -1000.0] + [0.0] * 8, [-3e38] * 9 + [3e38]], dtype=np.float32)
    out = post.infer({"LOGITS": huge})
    np.testing.assert_array_equal(out["LABEL"][:, 0], [0, 9])
    np.testing.assert_allclose(out["PROB"][:, 0], [1.0, 1.0])
    bad = np.zeros((3, 10), dtype=np.float32)
    bad[2, 4] = np.nan
    with pytest.raises(InvalidInput, match=r"LOGITS\[2\]"):
        post.infer({"LOGITS": bad})

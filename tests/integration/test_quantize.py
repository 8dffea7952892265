"""`pipeline quantize` on real models, and the INT8 version it writes served by the model service.

The digits CNN (TorchScript, trained by the examples' build) is quantized statically, calibrated on training
images, compared on the held-out ones, then served: version 2 is an ONNX file that ONNX Runtime runs, and its
accuracy on the held-out images is within half a point of the FP32 model's. A small ONNX model is quantized
from its `model_warmup` data and without any (dynamic), with the weights this CPU needs; acting as on a CPU
with VNNI and as on one without, the version written agrees with FP32 on this CPU, or (8-bit weights on a CPU
without VNNI, which saturate) is not written. A version that disagrees with FP32 is refused with the figure
unless forced. Bad samples and models quantize cannot take are refused with the reason.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.cli import main as pipeline_main
from pipeline.ensemble.catalog import load_catalog
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.errors import RepositoryError
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import Running, serving_router, serving_stages
from services.model import quantize as quantize_module
from services.model.backend import ModelBackend
from services.model.int8_cpu import int8_saturates
from services.model.quantize import QuantizeSettings, quantize
from tests.conftest import inference_stub, request_for, wait_serving
from tests.integration.test_model_service import infer, model_config, serving
from tests.model_files import ONNX_CONFIG, add_model, reference
from tests.stages import example_repository

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with the digits CNN built, and its training and held-out images as .npy files."""
    from examples.models.build import build
    from examples.models.digits import load_split

    root = tmp_path_factory.mktemp("built")
    build(root, ["digits_cnn"], progress=False, report=lambda _: None)
    x_train, _, x_test, y_test = load_split()
    np.save(root / "train.npy", x_train[:256])
    np.save(root / "test.npy", x_test)
    np.save(root / "labels.npy", y_test)
    return root


def fresh(digits: Path, tmp_path: Path) -> Path:
    shutil.copytree(digits / "digits_cnn", tmp_path / "digits_cnn")
    return tmp_path


async def test_the_digits_cnn_quantized_serves_as_version_2_with_its_accuracy(
    digits: Path, tmp_path: Path, capsys
) -> None:
    root = fresh(digits, tmp_path)
    code = pipeline_main(
        ["quantize", "--model-dir", str(root), "digits_cnn", "--calibration", str(digits / "train.npy"),
         "--evaluation", str(digits / "test.npy")]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "version 1 -> version 2 (INT8)" in printed and "static quantization, QDQ" in printed
    report = json.loads((root / "digits_cnn" / "2" / "quantization.json").read_text())
    assert report["method"] == "static" and report["evaluated_on"].endswith("(360 samples)")
    assert report["top1_agreement"]["LOGITS"] >= 0.99
    assert report["fp32"]["cpu_ms_per_batch"] > 0 and report["int8"]["cpu_ms_per_batch"] > 0

    import torch

    x_test, y_test = np.load(digits / "test.npy"), np.load(digits / "labels.npy")
    with torch.inference_mode():
        fp32 = torch.jit.load(str(root / "digits_cnn" / "1" / "model.pt"))(torch.from_numpy(x_test)).numpy()
    async with serving(root) as stub:
        await stub.RepositoryModelLoad(pb_load("digits_cnn"), timeout=120)
        config = await model_config(stub, "digits_cnn")
        assert config.platform == "onnxruntime_onnx"
        assert config.parameters["runner_in_use"].string_value == "onnxruntime on cpu"
        logits = []
        for start in range(0, len(x_test), 128):
            version, outputs = await infer(stub, "digits_cnn", INPUT=x_test[start : start + 128])
            assert version == "2"
            logits.append(outputs["LOGITS"])
    int8_accuracy = float(np.mean(np.concatenate(logits).argmax(1) == y_test))
    fp32_accuracy = float(np.mean(fp32.argmax(1) == y_test))
    assert abs(int8_accuracy - fp32_accuracy) <= 0.005, (int8_accuracy, fp32_accuracy)


@contextlib.asynccontextmanager
async def pipeline(root: Path) -> AsyncIterator[tuple[Running, Running]]:
    """Every model of `root` on one stage service (as each of the ensemble's stages), and the router."""
    backends = [PythonBackend(), ModelBackend(Runners(device="cpu"))]
    async with serving_stages(
        [],
        repository=ModelRepository(root),
        backends=backends,
        options={"model_control_mode": "explicit"},
        models=["digits_preprocess", "digits_cnn", "digits_postprocess"],
    ) as stage:
        await wait_serving(stage.address, timeout=120)
        environ = {f"{name}_ADDRESS": stage.address for name in ("PREPROCESS", "MODEL", "POSTPROCESS")}
        async with serving_router(load_catalog(repository=root, environ=environ)) as router:
            await wait_serving(router.address, timeout=60)
            yield stage, router


def png(digit: np.ndarray) -> bytes:
    grey = np.rint(digit * (255.0 / 16.0)).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(255 - grey, "L").resize((32, 32), Image.Resampling.NEAREST).save(buffer, "PNG")
    return buffer.getvalue()


async def test_the_digits_ensemble_takes_the_int8_version_on_load_and_back_on_rollback(
    digits: Path, tmp_path: Path
) -> None:
    root = example_repository(tmp_path / "repository", ["digits", "digits_preprocess", "digits_postprocess"])
    shutil.copytree(digits / "digits_cnn", root / "digits_cnn")
    x_test, y_test = np.load(digits / "test.npy"), np.load(digits / "labels.npy")
    images = np.empty((len(x_test), 1), dtype=object)
    images[:, 0] = [png(d) for d in x_test[:, 0]]

    async def accuracy(stub) -> float:
        labels = []
        for start in range(0, len(images), 64):
            reply = await stub.ModelInfer(request_for("digits", IMAGE=images[start : start + 64]), timeout=60)
            labels.append(response_tensors(reply)["LABEL"].to_array()[:, 0])
        return float(np.mean(np.concatenate(labels) == y_test))

    async with pipeline(root) as (model_stage, router), inference_stub(router.address) as stub:
        fp32 = await accuracy(stub)
        quantize(root, "digits_cnn", QuantizeSettings(calibration=digits / "train.npy", runs=2))
        # One stage serves every model of the pipeline; loading digits_cnn there swaps in version 2.
        async with inference_stub(model_stage.address) as stage:
            await stage.RepositoryModelLoad(pb_load("digits_cnn"), timeout=120)
            int8 = await accuracy(stub)
            config = (await stage.ModelConfig(pb.ModelConfigRequest(name="digits_cnn"))).config
            assert config.platform == "onnxruntime_onnx"
            assert abs(int8 - fp32) <= 0.005, (int8, fp32)
            # Rollback: the version folder goes, and a load serves version 1 again.
            shutil.rmtree(root / "digits_cnn" / "2")
            await stage.RepositoryModelLoad(pb_load("digits_cnn"), timeout=120)
            assert await accuracy(stub) == fp32
            config = (await stage.ModelConfig(pb.ModelConfigRequest(name="digits_cnn"))).config
            assert config.platform == "pytorch_libtorch"


def pb_load(name: str) -> pb.RepositoryModelLoadRequest:
    return pb.RepositoryModelLoadRequest(model_name=name)


NOISE = (
    '{ name: "%s", batch_size: 8, inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 4 ], '
    "random_data: true } } }"
)
#: Two samples with data, and one of zeros (which calibrates nothing and is left out).
WARMUP = (
    ONNX_CONFIG.format(name="tiny")
    + "model_warmup [ "
    + ", ".join([NOISE % "noise", NOISE.replace("random_data", "zero_data") % "zeros", NOISE % "more"])
    + " ]\n"
)


@pytest.mark.parametrize("warmup", [True, False], ids=["model_warmup", "none"])
async def test_an_onnx_model_quantizes_from_its_warmup_data_or_dynamically(
    tmp_path: Path, warmup: bool
) -> None:
    folder = add_model(tmp_path, "onnx", "tiny", {"1": 1}, config=WARMUP if warmup else None)
    report = quantize(tmp_path, "tiny")
    assert report.method == ("static" if warmup else "dynamic") and report.version == "2"
    assert report.calibration == ("model_warmup noise, more (16 samples)" if warmup else "")
    assert report.evaluated_on.startswith("the calibration samples" if warmup else "64 random inputs")
    # Without samples next to nothing is quantized here (its one MatMul): the report says so, and how to give them.
    note = "note: next to nothing was quantized"
    assert (note in report.text()) is not warmup and ("--calibration FILE" in report.text()) is not warmup
    x = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
    async with serving(tmp_path) as stub:
        await stub.RepositoryModelLoad(pb_load("tiny"), timeout=120)
        version, outputs = await infer(stub, "tiny", X=x)
    assert version == "2"
    np.testing.assert_allclose(outputs["Y"], reference(folder / "2" / "model.onnx", {"X": x})["Y"], atol=1e-6)
    # 7-bit weights where this CPU's 8-bit kernels saturate (no VNNI): the version agrees on any x86 CPU.
    assert report.reduce_range is int8_saturates()
    assert report.max_abs_diff["Y"] < 0.1 and report.agreement == {"Y": 1.0}
    if not warmup:  # dynamic quantization follows each batch's range: close on any input
        expected = reference(folder / "1" / "model.onnx", {"X": x})["Y"]
        assert np.max(np.abs(outputs["Y"] - expected)) < 0.05 * np.max(np.abs(expected))


@pytest.mark.parametrize("vnni", [False, True], ids=["as_without_vnni", "as_with_vnni"])
def test_the_weights_follow_the_cpu_and_a_saturated_version_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vnni: bool
) -> None:
    """Dynamic quantization, the case that saturates most (2.86 from FP32 with 8-bit weights on an AVX2-only
    CPU), acting as on a CPU with VNNI or without; the version is compared on this CPU."""
    saturates_here = int8_saturates()
    monkeypatch.setattr(quantize_module, "int8_saturates", lambda: not vnni)
    add_model(tmp_path, "onnx", "tiny", {"1": 1})
    if vnni and saturates_here:  # 8-bit weights on this CPU without VNNI: wrong answers, not written
        with pytest.raises(
            RepositoryError, match=r"below --min-agreement 98\.00%: 'Y' \d+\.\d+%; version 2 not"
        ):
            quantize(tmp_path, "tiny", QuantizeSettings(runs=1))
        assert not (tmp_path / "tiny" / "2").exists()
        return
    report = quantize(tmp_path, "tiny", QuantizeSettings(runs=1))
    assert report.method == "dynamic" and report.reduce_range is not vnni
    assert report.reduce_range_reason == (
        "this CPU's 8-bit kernels do not saturate"
        if vnni
        else "this CPU lacks VNNI: its 8-bit kernels can saturate"
    )
    assert report.agreement == {"Y": 1.0} and report.max_abs_diff["Y"] < 0.1, report.text()
    assert json.loads((tmp_path / "tiny" / "2" / "quantization.json").read_text())["reduce_range"] is not vnni


def test_a_version_that_disagrees_with_fp32_is_written_only_when_forced(tmp_path: Path, capsys) -> None:
    """Calibrated on inputs far smaller than those compared on: activations clip, on any CPU."""
    add_model(tmp_path, "onnx", "tiny", {"1": 1})
    rng = np.random.default_rng(2)
    np.save(tmp_path / "narrow.npy", rng.standard_normal((32, 4)).astype(np.float32) * 0.05)
    np.save(tmp_path / "wide.npy", rng.standard_normal((64, 4)).astype(np.float32) * 3)
    command = [
        "quantize",
        "--model-dir",
        str(tmp_path),
        "tiny",
        "--calibration",
        str(tmp_path / "narrow.npy"),
    ]
    command += ["--evaluation", str(tmp_path / "wide.npy")]
    assert pipeline_main(command) == 1
    printed = capsys.readouterr().out
    refusal = (
        r"agrees with FP32 on \S+wide\.npy \(64 samples\) below --min-agreement 98\.00%: 'Y' (\d+\.\d+)%"
    )
    found = re.search(refusal, printed)
    assert found and float(found.group(1)) < 90, printed
    assert "version 2 not written" in printed and "--force writes it anyway" in printed
    assert not (tmp_path / "tiny" / "2").exists()

    assert pipeline_main([*command, "--force"]) == 0
    printed = capsys.readouterr().out
    assert "written by --force: agreement below 98.00%" in printed
    report = json.loads((tmp_path / "tiny" / "2" / "quantization.json").read_text())
    assert report["forced"] is True and report["agreement"]["Y"] == float(found.group(1)) / 100
    # A lower bar lets it through without --force.
    assert pipeline_main([*command, "--version", "1", "--min-agreement", "0.1"]) == 0
    assert json.loads((tmp_path / "tiny" / "3" / "quantization.json").read_text())["forced"] is False


def test_samples_that_do_not_fit_and_models_it_cannot_take_are_refused(tmp_path: Path, capsys) -> None:
    add_model(tmp_path, "onnx", "tiny", {"1": 1})
    np.save(tmp_path / "wrong.npy", np.zeros((8, 5), np.float32))
    np.savez(tmp_path / "named.npz", Z=np.zeros((8, 4), np.float32))
    cases = [
        (
            ["tiny", "--calibration", str(tmp_path / "wrong.npy")],
            "'X' has shape [8, 5]; expected [samples, 4]",
        ),
        (["tiny", "--calibration", str(tmp_path / "named.npz")], "unknown: Z; missing: X"),
        (["tiny", "--method", "static"], "static quantization needs calibration samples"),
        (["absent"], "absent"),
    ]
    for args, words in cases:
        assert pipeline_main(["quantize", "--model-dir", str(tmp_path), *args]) == 1
        assert words in capsys.readouterr().out
    assert not (tmp_path / "tiny" / "2").exists()
    # The newest version quantized already: refused, pointing to --version.
    assert pipeline_main(["quantize", "--model-dir", str(tmp_path), "tiny"]) == 0
    assert pipeline_main(["quantize", "--model-dir", str(tmp_path), "tiny"]) == 1
    assert "version 2 is quantized already (DynamicQuantizeLinear, MatMulInteger)" in capsys.readouterr().out
    assert pipeline_main(["quantize", "--model-dir", str(tmp_path), "tiny", "--version", "1"]) == 0
    assert (tmp_path / "tiny" / "3" / "model.onnx").is_file()
    (tmp_path / "py" / "1").mkdir(parents=True)
    (tmp_path / "py" / "config.pbtxt").write_text('backend: "python"')
    with pytest.raises(Exception, match="quantize takes ONNX and PyTorch models"):
        quantize(tmp_path, "py", QuantizeSettings())


def test_the_command_line_is_read_into_its_settings_and_a_bad_value_is_named(tmp_path, monkeypatch, capsys):
    """`pipeline quantize` reads its flags (and PIPELINE_MODEL_DIR) into its settings model; a value the
    model refuses stops it with a usage error that names it, and nothing is quantized."""
    monkeypatch.setenv("PIPELINE_MODEL_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit) as refused:
        pipeline_main(["quantize", "tiny", "--min-agreement", "2"])
    assert refused.value.code == 2
    said = capsys.readouterr().err
    assert "--min-agreement" in said and "the least agreement is a share from 0 to 1, got 2.0" in said
    assert pipeline_main(["quantize", "tiny"]) == 1
    assert str(tmp_path / "nowhere") in capsys.readouterr().out

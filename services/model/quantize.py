"""`pipeline quantize`: an INT8 version of a model beside its FP32 one, with its accuracy and speed measured.

A model of the repository (an ONNX file, or a PyTorch file through its ONNX export) is quantized with ONNX
Runtime's tools (`onnxruntime.quantization`) into the model's next version: `<model>/<N+1>/model.onnx`, and
beside it `quantization.json`, the report. The config is the model's own (Triton's versions share one
`config.pbtxt`): the INT8 file keeps the model's tensor names, and a PyTorch model's version may hold a
`model.onnx` (`services.model.backend.ModelBackend.read`). Serving it is an ordinary version load (the default
version policy serves the latest), and going back is removing the folder or pinning the version policy.

- Static quantization (weights and activations in INT8) is calibrated on samples: a `.npy` (one input) or
  `.npz` (by input name) the user gives, else the model's `model_warmup` samples that carry data
  (`input_data_file` or `random_data`; zeros calibrate nothing). Without samples, dynamic quantization
  (weights in INT8, activations quantized per batch as it runs) of the matrix products (MatMul, Gemm,
  attention, LSTM/GRU), as ONNX Runtime advises: its dynamically quantized convolution (ConvInteger) runs
  slower than FP32 on the CPU, so convolutions stay FP32 (a CNN gains from static quantization alone).
- Weights take 8 bits, or 7 (`reduce_range`) where this CPU's 8-bit kernels can saturate (an x86 CPU without
  VNNI: `services.model.int8_cpu`); `--reduce-range` / `--no-reduce-range` choose otherwise.
- The INT8 file is compared with the FP32 one on the same inputs (the evaluation file, else the calibration
  samples, else random inputs) before anything is written: per output, its agreement (the share of items
  whose top-1 over the last axis is FP32's where the output scores classes, else whose values are within
  `TOLERANCE` of FP32's) and the largest absolute difference. A version whose agreement falls below
  `min_agreement` on any output is not written unless forced: served, it would give wrong answers. The
  report adds the CPU time per batch of each file in ONNX Runtime (one intra-op thread, as the service runs
  an instance), FP32 being the ONNX file or the PyTorch file's export.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pipeline.protocol.errors import RepositoryError
from pipeline.protocol.model_config import tensor_specs
from pipeline.runtime.repository import ModelRepository, RepositoryEntry
from pipeline.runtime.service_settings import Repository, Runners
from pipeline.runtime.settings_cli import ProcessSettings, option, process_settings
from pipeline.runtime.settings_values import SettingValueError
from services.model.artifacts import ONNX, export_onnx, first_line
from services.model.backend import ONNX_FILENAME, ModelBackend, ModelFile
from services.model.int8_cpu import int8_saturates
from services.model.quantize_report import (
    MIN_AGREEMENT,
    TOLERANCE,
    Report,
    check_agreement,
    compare_outputs,
    timings,
)
from services.model.quantize_samples import (
    batch_feeds,
    batches,
    calibration_samples,
    evaluation_samples,
)

log = logging.getLogger(__name__)

METHODS = ("auto", "static", "dynamic")
FORMATS = ("qdq", "qoperator")
#: The report's file, in the new version's folder.
REPORT_FILE = "quantization.json"
#: Operators that say a file is quantized already.
QUANTIZED_OPERATORS = {
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
    "MatMulInteger", "ConvInteger", "QGemm",
}  # fmt: skip
#: The operators dynamic quantization quantizes.
DYNAMIC_OPERATORS = ["MatMul", "Gemm", "Attention", "LSTM", "GRU"]


def _choice(name: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    """A check (and an argparse type) that a value is one of `choices`."""

    def check(value: str) -> str:
        if value not in choices:
            raise SettingValueError(f"unknown {name} {value!r}; expected one of {', '.join(choices)}")
        return value

    return check


def _share(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise SettingValueError(f"the least agreement is a share from 0 to 1, got {value}")
    return value


class QuantizeSettings(BaseModel):
    """How to quantize: `pipeline quantize`'s flags, or what code that quantizes gives."""

    model_config = ConfigDict(frozen=True)

    #: The version quantized (None: the newest).
    version: Annotated[
        str | None, option("--version", help="the version to quantize (default: the newest)")
    ] = None
    #: Calibration samples (.npy or .npz); None: the model's model_warmup data.
    calibration: Annotated[
        Path | None,
        option(
            "--calibration",
            parse=Path,
            help="calibration samples: a .npy (a model with one input) or .npz (an array per input name), "
            "batch first (default: the model's model_warmup samples that carry data; none: dynamic "
            "quantization)",
        ),
    ] = None
    #: Inputs the report compares on (.npy or .npz); None: the calibration samples.
    evaluation: Annotated[
        Path | None,
        option(
            "--evaluation",
            parse=Path,
            help="inputs to compare INT8 with FP32 on, as --calibration (default: the calibration samples)",
        ),
    ] = None
    #: "auto" (static with calibration samples, else dynamic), "static" or "dynamic".
    method: Annotated[
        str,
        AfterValidator(_choice("method", METHODS)),
        option(
            "--method",
            parse=_choice("method", METHODS),
            metavar="{" + ",".join(METHODS) + "}",
            help="static (calibrated), dynamic, or auto: static when there are samples (default %(default)s)",
        ),
    ] = "auto"
    #: Static quantization's graph: "qdq" (QuantizeLinear/DequantizeLinear pairs, which ONNX Runtime fuses into
    #: INT8 kernels) or "qoperator" (QLinearConv, QLinearMatMul...).
    format: Annotated[
        str,
        AfterValidator(_choice("format", FORMATS)),
        option(
            "--format",
            parse=_choice("format", FORMATS),
            metavar="{" + ",".join(FORMATS) + "}",
            help="static quantization's graph: QuantizeLinear/DequantizeLinear pairs (qdq) or QLinear operators "
            "(qoperator) (default %(default)s)",
        ),
    ] = "qdq"
    #: Weights quantized per output channel rather than per tensor.
    per_channel: Annotated[
        bool,
        option(
            "--per-tensor",
            action="store_false",
            help="one scale per weight tensor instead of one per output channel",
        ),
    ] = True
    #: Weights in 7 bits, for CPUs without VNNI whose 8-bit multiply-adds can saturate; None: where this CPU's
    #: can (`services.model.int8_cpu.int8_saturates`).
    reduce_range: Annotated[
        bool | None,
        option(
            "--reduce-range",
            action="boolean",
            help="7-bit weights, which no CPU's 8-bit kernels saturate, or 8-bit ones (default: 7 bits where "
            "this CPU lacks VNNI, an x86 CPU with AVX2 or AVX-512 only, where 8 bits can saturate; else 8)",
        ),
    ] = None
    #: The least agreement with FP32 (0 to 1) of every output of a version that is written.
    min_agreement: Annotated[
        float,
        AfterValidator(_share),
        option(
            "--min-agreement",
            parse=float,
            help="the least share of compared items on which every output agrees with FP32 (its top-1 where it "
            f"scores classes, else within {TOLERANCE * 100:.0f}%% of its spread); a version below it is not "
            "written (default %(default)s)",
        ),
    ] = MIN_AGREEMENT
    #: Write the version whatever its agreement.
    force: Annotated[
        bool,
        option(
            "--force",
            action="store_true",
            help="write the version even where it agrees less than --min-agreement",
        ),
    ] = False
    #: The batch the speed is measured at (at most the model's max_batch_size).
    batch_size: Annotated[
        int,
        Field(ge=1),
        option(
            "--batch-size",
            parse=int,
            help="the batch the speed is measured at (default %(default)s)",
        ),
    ] = 16
    #: Timed runs of each file per round (`ROUNDS` rounds, alternating between the files).
    runs: Annotated[int, Field(ge=1)] = 20


class QuantizeTarget(BaseModel):
    """The model `pipeline quantize` quantizes."""

    model: Annotated[
        str, option("model", help="the model to quantize (an ONNX or PyTorch model of the repository)")
    ]


#: `pipeline quantize`'s settings: the model, the model repository (`--model-dir`, env `PIPELINE_MODEL_DIR`)
#: and how to quantize.
QuantizeCommand = process_settings("QuantizeCommand", (QuantizeTarget, Repository, QuantizeSettings))


def quantize(root: str | os.PathLike[str], name: str, settings: QuantizeSettings | None = None) -> Report:
    """Write the INT8 version of model `name` of the repository at `root` and its report; `RepositoryError`
    naming what is wrong (a model of another backend, a stateful model, samples that do not fit, an INT8
    file that disagrees with FP32 where not forced)."""
    settings = settings or QuantizeSettings()
    entry = ModelRepository(root).read(name)
    source_version, model = _source_model(entry, name, settings)
    inputs, outputs = tensor_specs(model.config, entry.source)
    calibration, calibrated_on = calibration_samples(entry, model, inputs, settings.calibration)
    method = _method(settings.method, bool(calibration), entry.source)
    max_batch = model.config.max_batch_size
    evaluation, evaluated_on = evaluation_samples(settings.evaluation, inputs, max_batch, calibration)
    reduce_range, reduce_range_reason = _weight_bits(settings.reduce_range)
    settings = settings.model_copy(update={"reduce_range": reduce_range})
    version = str(max(int(v) for v in entry.versions) + 1)
    with tempfile.TemporaryDirectory(prefix="pipeline-quantize-") as tmp:
        fp32 = _fp32_onnx(model, Path(tmp))
        _check_fp32(fp32, model, source_version)
        int8 = Path(tmp) / "int8.onnx"
        _quantize_file(fp32, int8, method, calibration, settings, Path(tmp))
        fp32_session, int8_session = _session(fp32), _session(int8)
        names = [spec.name for spec in outputs]
        batch = min(settings.batch_size, max_batch or 1)
        report = Report(
            model=name,
            source_version=source_version,
            version=version,
            path=str(entry.folder / version / ONNX_FILENAME),
            method=method,
            format=settings.format,
            per_channel=settings.per_channel,
            reduce_range=reduce_range,
            reduce_range_reason=reduce_range_reason,
            calibration=calibrated_on if method == "static" else "",
            evaluated_on=evaluated_on,
            min_agreement=settings.min_agreement,
            batch_size=batch,
            fp32_bytes=fp32.stat().st_size,
            int8_bytes=int8.stat().st_size,
            operators=_operators(int8),
        )
        compare_outputs(report, fp32_session, int8_session, evaluation, names)
        saturated = not reduce_range and int8_saturates()
        check_agreement(
            report, settings.force, "this CPU lacks VNNI: try --reduce-range" if saturated else ""
        )
        feeds = batch_feeds(evaluation, batch, max_batch > 0)
        report.fp32, report.int8 = timings([fp32_session, int8_session], feeds, names, settings.runs, batch)
        _write_version(entry, version, int8, report)
    log.info("wrote %s", report.path)
    return report


def _method(method: str, calibrated: bool, source: str) -> str:
    """The method `auto` stands for (static with calibration samples, else dynamic); static without samples
    is refused."""
    if method == "auto":
        method = "static" if calibrated else "dynamic"
    if method == "static" and not calibrated:
        raise RepositoryError(
            f"{source}: static quantization needs calibration samples: give --calibration FILE (.npy or "
            ".npz), or model_warmup samples with data (input_data_file or random_data)"
        )
    return method


def _weight_bits(reduce_range: bool | None) -> tuple[bool, str]:
    """Whether weights take 7 bits, and why: as the flag says, else as this CPU's 8-bit kernels need."""
    if reduce_range is not None:
        return reduce_range, "--reduce-range" if reduce_range else "--no-reduce-range"
    if int8_saturates():
        return True, "this CPU lacks VNNI: its 8-bit kernels can saturate"
    return False, "this CPU's 8-bit kernels do not saturate"


def _check_fp32(fp32: Path, model: ModelFile, source_version: str) -> None:
    """Refuse a version that is quantized already."""
    quantized = sorted(set(_operators(fp32)) & QUANTIZED_OPERATORS)
    if quantized:
        raise RepositoryError(
            f"{model.artifact}: version {source_version} is quantized already ({', '.join(quantized)}); "
            "give --version of an FP32 version"
        )


def _source_model(entry: RepositoryEntry, name: str, settings: QuantizeSettings) -> tuple[str, ModelFile]:
    """The version to quantize (`--version`, else the latest) and its model file, on the CPU; refused for
    a backend other than ONNX or PyTorch and for a stateful model."""
    if entry.backend not in ("onnxruntime", "pytorch"):
        raise RepositoryError(
            f"{entry.source}: quantize takes ONNX and PyTorch models; this one's backend is {entry.backend}"
        )
    if not entry.versions:
        raise RepositoryError(f"model '{name}': no version folder in {entry.folder}")
    source_version = settings.version or max(entry.versions, key=int)
    model = ModelBackend(Runners(device="cpu")).read(entry, source_version)
    if model.config.HasField("sequence_batching"):
        raise RepositoryError(
            f"{entry.source}: quantize does not take a model with sequence_batching (its state tensors cannot "
            "be calibrated from independent samples)"
        )
    return source_version, model


# ---- files and sessions ---------------------------------------------------------------------------------------


def _fp32_onnx(model: ModelFile, folder: Path) -> Path:
    """The FP32 model as ONNX, with the config's tensor names: the file itself, or a PyTorch file's export."""
    if model.kind == ONNX:
        return model.artifact
    inputs = [dataclasses.replace(b, model_name=b.name) for b in model.bindings.inputs]
    outputs = [dataclasses.replace(b, model_name=b.name) for b in model.bindings.outputs]
    try:
        return export_onnx(
            model.artifact,
            model.kind,
            inputs,
            outputs,
            folder / "fp32.onnx",
            batching=model.config.max_batch_size > 0,
        )
    except Exception as exc:  # torch.onnx's own errors (an operator it cannot export...)
        raise RepositoryError(f"{model.artifact}: cannot export it to ONNX: {first_line(exc)}") from None


class _Reader:
    """Calibration batches for `onnxruntime.quantization` (a `CalibrationDataReader`)."""

    def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
        self._batches = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)


def _quantize_file(
    fp32: Path,
    int8: Path,
    method: str,
    calibration: Mapping[str, np.ndarray],
    settings: QuantizeSettings,
    folder: Path,
) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = folder / "prepared.onnx"
    try:
        quant_pre_process(str(fp32), str(prepared))
    except Exception as exc:  # shape inference may not know an operator; quantizing goes on without it
        log.warning("%s: quantization pre-processing failed (%s); quantizing the file as it is", fp32, exc)
        prepared = fp32
    try:
        if method == "dynamic":
            quantize_dynamic(
                str(prepared),
                str(int8),
                op_types_to_quantize=DYNAMIC_OPERATORS,
                per_channel=settings.per_channel,
                reduce_range=settings.reduce_range,
                weight_type=QuantType.QInt8,
            )
            return
        calibration_batches = list(batches(calibration, 32, True)) if calibration else []
        quantize_static(
            str(prepared),
            str(int8),
            _Reader(calibration_batches),
            quant_format=QuantFormat.QDQ if settings.format == "qdq" else QuantFormat.QOperator,
            per_channel=settings.per_channel,
            reduce_range=settings.reduce_range,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
    except Exception as exc:
        raise RepositoryError(f"{fp32}: ONNX Runtime cannot quantize it: {first_line(exc)}") from None


def _operators(path: Path) -> dict[str, int]:
    import onnx

    counts = Counter(node.op_type for node in onnx.load(str(path)).graph.node)
    return dict(counts.most_common())


def _session(path: Path) -> Any:
    """A CPU session as the model service opens one: one intra-op thread, sequential."""
    import onnxruntime as ort

    ort.disable_telemetry_events()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise RepositoryError(f"{path}: ONNX Runtime cannot load it: {first_line(exc)}") from None


def _write_version(entry: RepositoryEntry, version: str, int8: Path, report: Report) -> None:
    """The version folder, written under a temporary name then renamed: the service polling the repository
    never sees a version without its file."""
    partial = Path(tempfile.mkdtemp(dir=entry.folder, prefix=".partial-"))
    try:
        shutil.copyfile(int8, partial / ONNX_FILENAME)
        (partial / REPORT_FILE).write_text(json.dumps(asdict(report), indent=1) + "\n")
        for path in (partial, partial / ONNX_FILENAME, partial / REPORT_FILE):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)  # a service may run as another user
        os.rename(partial, entry.folder / version)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


# ---- command line ---------------------------------------------------------------------------------------------


def run_quantize_command(settings: ProcessSettings) -> int:
    """Quantize, print the report; 1 with the reason when the model cannot be quantized."""
    root, name = settings.group(Repository).model_dir, settings.group(QuantizeTarget).model
    try:
        report = quantize(root, name, settings.group(QuantizeSettings))
    except RepositoryError as exc:
        print(f"pipeline quantize: {getattr(exc, 'message', exc)}")
        return 1
    print(report.text())
    return 0

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
- The report compares the INT8 file with the FP32 one on the same inputs (the evaluation file, else the
  calibration samples, else random inputs): top-1 agreement of each output's last axis and the largest
  absolute difference; and the CPU time per batch of each in ONNX Runtime (one intra-op thread, as the
  service runs an instance), FP32 being the ONNX file or the PyTorch file's export.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.protocol.datatypes import DATATYPES
from pipeline.protocol.errors import RepositoryError
from pipeline.protocol.model_config import tensor_specs
from pipeline.protocol.types import TensorSpec
from pipeline.runtime import settings as runtime_settings
from pipeline.runtime.repository import ModelRepository, RepositoryEntry
from pipeline.stage.warmup import warmup_samples
from services.model.artifacts import ONNX, export_onnx, first_line
from services.model.backend import ONNX_FILENAME, ModelBackend, ModelFile, ServiceSettings

log = logging.getLogger(__name__)

METHODS = ("auto", "static", "dynamic")
FORMATS = ("qdq", "qoperator")
#: The report's file, in the new version's folder.
REPORT_FILE = "quantization.json"
#: Inputs compared when no file gives them (random, from a fixed seed).
RANDOM_SAMPLES = 64
#: Operators that say a file is quantized already.
QUANTIZED_OPERATORS = {
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
    "MatMulInteger", "ConvInteger", "QGemm",
}  # fmt: skip
#: Timed rounds of each file (the best counts).
ROUNDS = 5
#: The operators dynamic quantization quantizes.
DYNAMIC_OPERATORS = ["MatMul", "Gemm", "Attention", "LSTM", "GRU"]


@dataclass(frozen=True)
class QuantizeSettings:
    """How to quantize (the command line's flags)."""

    #: "auto" (static with calibration samples, else dynamic), "static" or "dynamic".
    method: str = "auto"
    #: Static quantization's graph: "qdq" (QuantizeLinear/DequantizeLinear pairs, which ONNX Runtime fuses into
    #: INT8 kernels) or "qoperator" (QLinearConv, QLinearMatMul...).
    format: str = "qdq"
    #: Weights quantized per output channel rather than per tensor.
    per_channel: bool = True
    #: Weights in 7 bits, for CPUs without VNNI whose 8-bit multiply-adds can saturate.
    reduce_range: bool = False
    #: Calibration samples (.npy or .npz); None: the model's model_warmup data.
    calibration: Path | None = None
    #: Inputs the report compares on (.npy or .npz); None: the calibration samples.
    evaluation: Path | None = None
    #: The version quantized (None: the newest).
    version: str | None = None
    #: The batch the speed is measured at (at most the model's max_batch_size).
    batch_size: int = 16
    #: Timed runs of each file per round (`ROUNDS` rounds, alternating between the files).
    runs: int = 20

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; expected one of {', '.join(METHODS)}")
        if self.format not in FORMATS:
            raise ValueError(f"unknown format {self.format!r}; expected one of {', '.join(FORMATS)}")
        if self.batch_size < 1 or self.runs < 1:
            raise ValueError("batch size and runs must be >= 1")


@dataclass
class Timing:
    """One file's speed in ONNX Runtime at one batch size."""

    #: Process CPU time per batch, milliseconds (one intra-op thread).
    cpu_ms_per_batch: float
    #: Wall time per batch, milliseconds.
    wall_ms_per_batch: float
    cpu_ms_per_item: float


@dataclass
class Report:
    """What `quantize` wrote, and how the INT8 file compares with the FP32 one."""

    model: str
    source_version: str
    version: str
    path: str
    method: str
    format: str
    per_channel: bool
    reduce_range: bool
    #: Where the calibration samples came from, and how many ("" for dynamic quantization).
    calibration: str
    #: Where the compared inputs came from, and how many.
    evaluated_on: str
    #: Per output: the fraction of items whose top-1 (argmax over the last axis) is the FP32 file's.
    top1_agreement: dict[str, float] = field(default_factory=dict)
    #: Per output: the largest absolute difference from the FP32 file's.
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    batch_size: int = 0
    fp32: Timing | None = None
    int8: Timing | None = None
    fp32_bytes: int = 0
    int8_bytes: int = 0
    #: The INT8 file's operators and how many of each.
    operators: dict[str, int] = field(default_factory=dict)

    @property
    def cpu_speedup(self) -> float:
        """FP32's CPU time per batch over INT8's."""
        if not (self.fp32 and self.int8 and self.int8.cpu_ms_per_batch):
            return 0.0
        return self.fp32.cpu_ms_per_batch / self.int8.cpu_ms_per_batch

    def text(self) -> str:
        """The report for people."""
        lines = [
            f"model '{self.model}' version {self.source_version} -> version {self.version} (INT8): {self.path}",
            f"  {self.method} quantization"
            + (f", {self.format.upper()}" if self.method == "static" else "")
            + f", weights per {'channel' if self.per_channel else 'tensor'}"
            + (", reduced range" if self.reduce_range else "")
            + (f"; calibrated on {self.calibration}" if self.calibration else ""),
            f"  size: {self.fp32_bytes / 1e6:.2f} MB FP32 -> {self.int8_bytes / 1e6:.2f} MB INT8; operators: "
            + ", ".join(f"{op} x{n}" for op, n in self.operators.items()),
            f"  compared on {self.evaluated_on}:",
        ]
        for name, diff in self.max_abs_diff.items():
            agreement = self.top1_agreement.get(name)
            top1 = f"top-1 agreement {agreement:.2%}, " if agreement is not None else ""
            lines.append(f"    {name}: {top1}max abs difference {diff:.4g}")
        if self.fp32 and self.int8:
            lines.append(
                f"  CPU per batch of {self.batch_size} (ONNX Runtime, 1 thread, best of {ROUNDS} rounds): FP32 "
                f"{self.fp32.cpu_ms_per_batch:.3f} ms, INT8 {self.int8.cpu_ms_per_batch:.3f} ms "
                f"({self.cpu_speedup:.2f}x)"
            )
        return "\n".join(lines)


def quantize(root: str | os.PathLike[str], name: str, settings: QuantizeSettings | None = None) -> Report:
    """Write the INT8 version of model `name` of the repository at `root` and its report; `RepositoryError`
    naming what is wrong (a model of another backend, a stateful model, samples that do not fit)."""
    settings = settings or QuantizeSettings()
    entry = ModelRepository(root).read(name)
    source_version, model = _source_model(entry, name, settings)
    inputs, outputs = tensor_specs(model.config, entry.source)
    calibration, calibrated_on = _calibration_samples(entry, model, inputs, settings)
    method = settings.method
    if method == "auto":
        method = "static" if calibration else "dynamic"
    if method == "static" and not calibration:
        raise RepositoryError(
            f"{entry.source}: static quantization needs calibration samples: give --calibration FILE (.npy or "
            ".npz), or model_warmup samples with data (input_data_file or random_data)"
        )
    evaluation, evaluated_on = _evaluation_samples(settings, inputs, model.config.max_batch_size, calibration)
    version = str(max(int(v) for v in entry.versions) + 1)
    with tempfile.TemporaryDirectory(prefix="pipeline-quantize-") as tmp:
        fp32 = _fp32_onnx(model, Path(tmp))
        quantized = sorted(set(_operators(fp32)) & QUANTIZED_OPERATORS)
        if quantized:
            raise RepositoryError(
                f"{model.artifact}: version {source_version} is quantized already ({', '.join(quantized)}); "
                "give --version of an FP32 version"
            )
        int8 = Path(tmp) / "int8.onnx"
        _quantize_file(fp32, int8, method, calibration, settings, Path(tmp))
        fp32_session, int8_session = _session(fp32), _session(int8)
        names = [spec.name for spec in outputs]
        batch = min(settings.batch_size, model.config.max_batch_size or 1)
        report = Report(
            model=name,
            source_version=source_version,
            version=version,
            path=str(entry.folder / version / ONNX_FILENAME),
            method=method,
            format=settings.format,
            per_channel=settings.per_channel,
            reduce_range=settings.reduce_range,
            calibration=calibrated_on if method == "static" else "",
            evaluated_on=evaluated_on,
            batch_size=batch,
            fp32_bytes=fp32.stat().st_size,
            int8_bytes=int8.stat().st_size,
            operators=_operators(int8),
        )
        _compare_outputs(report, fp32_session, int8_session, evaluation, names)
        feeds = _batch_feeds(evaluation, batch, model.config.max_batch_size > 0)
        report.fp32, report.int8 = _timings([fp32_session, int8_session], feeds, names, settings.runs, batch)
        _write_version(entry, version, int8, report)
    log.info("wrote %s", report.path)
    return report


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
    model = ModelBackend(ServiceSettings(device="cpu")).read(entry, source_version)
    if model.config.HasField("sequence_batching"):
        raise RepositoryError(
            f"{entry.source}: quantize does not take a model with sequence_batching (its state tensors cannot "
            "be calibrated from independent samples)"
        )
    return source_version, model


# ---- samples --------------------------------------------------------------------------------------------------


def _count(samples: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(samples.values()))) if samples else 0


def _calibration_samples(
    entry: RepositoryEntry, model: ModelFile, inputs: Sequence[TensorSpec], settings: QuantizeSettings
) -> tuple[dict[str, np.ndarray], str]:
    """The calibration samples by input name (batch first), and where they came from."""
    if settings.calibration is not None:
        samples = _read_samples(settings.calibration, inputs, model.config.max_batch_size)
        return samples, f"{settings.calibration} ({_count(samples)} samples)"
    with_data = [
        w
        for w in model.config.model_warmup
        if any(i.WhichOneof("input_data_type") != "zero_data" for i in w.inputs.values())
    ]
    if not with_data:
        return {}, ""
    config = type(model.config)()
    config.CopyFrom(model.config)
    del config.model_warmup[:]
    config.model_warmup.extend(with_data)
    warmups = warmup_samples(config, inputs, entry.folder, entry.source)
    if model.config.max_batch_size == 0 or len(warmups) == 1:
        merged = warmups[0].inputs
    else:
        merged = {k: np.concatenate([s.inputs[k] for s in warmups]) for k in warmups[0].inputs}
    names = ", ".join(s.name for s in warmups)
    return dict(merged), f"model_warmup {names} ({_count(merged)} samples)"


def _evaluation_samples(
    settings: QuantizeSettings,
    inputs: Sequence[TensorSpec],
    max_batch_size: int,
    calibration: dict[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], str]:
    """The samples the two versions are compared on, and what they are: `--evaluation`'s, else the
    calibration samples, else random inputs."""
    if settings.evaluation is not None:
        evaluation = _read_samples(settings.evaluation, inputs, max_batch_size)
        return evaluation, f"{settings.evaluation} ({_count(evaluation)} samples)"
    if calibration:
        return calibration, f"the calibration samples ({_count(calibration)})"
    evaluation = _random_inputs(inputs, max_batch_size)
    return evaluation, f"{_count(evaluation)} random inputs (closeness, not accuracy)"


def _read_samples(path: Path, inputs: Sequence[TensorSpec], max_batch_size: int) -> dict[str, np.ndarray]:
    """Samples from a `.npy` file (a model with one input) or a `.npz` file (an array per input name), each
    shaped as the input with the batch first (a model that does not batch: a leading axis of samples)."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise RepositoryError(f"{path}: cannot read samples: {first_line(exc)}") from None
    required = [spec for spec in inputs if not spec.optional]
    if isinstance(loaded, np.ndarray):
        if len(required) != 1:
            raise RepositoryError(
                f"{path}: a .npy file gives one input, and the model takes {len(required)} "
                f"({', '.join(s.name for s in required)}); give a .npz with an array per input"
            )
        arrays = {required[0].name: loaded}
    else:
        arrays = {key: loaded[key] for key in loaded.files}
        known = {spec.name for spec in inputs}
        unknown = sorted(set(arrays) - known)
        missing = sorted(spec.name for spec in required if spec.name not in arrays)
        if unknown or missing:
            raise RepositoryError(
                f"{path}: its arrays must be the model's inputs ({', '.join(sorted(known))}); "
                + "; ".join(
                    part
                    for part in (
                        f"unknown: {', '.join(unknown)}" if unknown else "",
                        f"missing: {', '.join(missing)}" if missing else "",
                    )
                    if part
                )
            )
    samples: dict[str, np.ndarray] = {}
    for spec in inputs:
        if spec.name not in arrays:
            continue
        array = arrays[spec.name]
        item_shape = spec.shape[1:] if max_batch_size > 0 else spec.shape
        if array.ndim != len(item_shape) + 1 or any(
            d not in (-1, s) for d, s in zip(item_shape, array.shape[1:], strict=True)
        ):
            raise RepositoryError(
                f"{path}: '{spec.name}' has shape {list(array.shape)}; expected [samples, "
                f"{', '.join(str(d) for d in item_shape)}]"
            )
        samples[spec.name] = array.astype(DATATYPES[spec.datatype], copy=False)
    counts = {len(a) for a in samples.values()}
    if len(counts) != 1 or 0 in counts:
        raise RepositoryError(f"{path}: every input needs the same number of samples, at least one")
    return samples


def _random_inputs(inputs: Sequence[TensorSpec], max_batch_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    samples = {}
    for spec in inputs:
        item = [1 if d == -1 else d for d in (spec.shape[1:] if max_batch_size > 0 else spec.shape)]
        dtype = DATATYPES[spec.datatype]
        shape = (RANDOM_SAMPLES, *item)
        if dtype.kind == "f":
            samples[spec.name] = rng.standard_normal(shape).astype(dtype)
        else:
            samples[spec.name] = rng.integers(0, 2, shape).astype(dtype)
    return samples


def _batches(
    samples: Mapping[str, np.ndarray], batch: int, batching: bool
) -> Iterator[dict[str, np.ndarray]]:
    """The samples in batches of `batch` (one at a time, without the sample axis, for a model that does not
    batch)."""
    count = _count(samples)
    if not batching:
        for i in range(count):
            yield {k: v[i] for k, v in samples.items()}
        return
    for start in range(0, count, batch):
        yield {k: v[start : start + batch] for k, v in samples.items()}


def _batch_feeds(samples: Mapping[str, np.ndarray], batch: int, batching: bool) -> dict[str, np.ndarray]:
    """One batch of `batch` items for timing (the samples repeated if there are fewer)."""
    if not batching:
        return {k: v[0] for k, v in samples.items()}
    reps = -(-batch // _count(samples))
    return {k: np.concatenate([v] * reps)[:batch] for k, v in samples.items()}


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
        batches = list(_batches(calibration, 32, True)) if calibration else []
        quantize_static(
            str(prepared),
            str(int8),
            _Reader(batches),
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


def _compare_outputs(
    report: Report,
    fp32: Any,
    int8: Any,
    evaluation: Mapping[str, np.ndarray],
    names: list[str],
) -> None:
    """Each output's largest difference between the two versions on `evaluation`, and where it is a
    score per class, how often the two agree on the top class (in `report`)."""
    batch = report.batch_size
    expected = _run_all(fp32, evaluation, names, batch)
    got = _run_all(int8, evaluation, names, batch)
    for output in names:
        a, b = expected[output], got[output]
        report.max_abs_diff[output] = float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0
        if a.dtype.kind == "f" and a.ndim >= 2 and a.shape[-1] > 1:
            report.top1_agreement[output] = float(np.mean(a.argmax(-1) == b.argmax(-1)))


def _run_all(
    session: Any, samples: Mapping[str, np.ndarray], names: list[str], batch: int
) -> dict[str, np.ndarray]:
    """Every sample through `session`, outputs stacked by name."""
    feeds = [i.name for i in session.get_inputs()]
    batching = len(session.get_inputs()[0].shape) > 0 and _count(samples) > 0
    results: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for inputs in _batches(samples, batch, batching):
        produced = session.run(names, {k: v for k, v in inputs.items() if k in feeds})
        for name, array in zip(names, produced, strict=True):
            results[name].append(array)
    return {n: np.concatenate(arrays) for n, arrays in results.items()}


def _timings(
    sessions: Sequence[Any], feeds: Mapping[str, np.ndarray], names: list[str], runs: int, batch: int
) -> list[Timing]:
    """Each session's CPU and wall time per run of one batch: after a few untimed runs, `ROUNDS` rounds of
    `runs` runs that alternate between the sessions, the best round of each counting (the least disturbed by
    the machine's other work)."""
    for session in sessions:
        for _ in range(3):
            session.run(names, dict(feeds))
    best = [(float("inf"), float("inf"))] * len(sessions)
    for _ in range(ROUNDS):
        for index, session in enumerate(sessions):
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(runs):
                session.run(names, dict(feeds))
            measured = ((time.process_time() - cpu) * 1e3 / runs, (time.perf_counter() - wall) * 1e3 / runs)
            best[index] = min(best[index], measured)
    return [Timing(round(cpu, 4), round(wall, 4), round(cpu / batch, 4)) for cpu, wall in best]


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


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    """`pipeline quantize`'s flags."""
    parser.add_argument("model", help="the model to quantize (an ONNX or PyTorch model of the repository)")
    parser.add_argument(
        "--model-dir",
        "--model-repository",
        dest="model_dir",
        default=runtime_settings.MODEL_DIR.get(),
        help="the Triton model repository (env PIPELINE_MODEL_DIR; default %(default)s)",
    )
    parser.add_argument("--version", help="the version to quantize (default: the newest)")
    parser.add_argument(
        "--calibration",
        type=Path,
        help="calibration samples: a .npy (a model with one input) or .npz (an array per input name), batch "
        "first (default: the model's model_warmup samples that carry data; none: dynamic quantization)",
    )
    parser.add_argument(
        "--evaluation",
        type=Path,
        help="inputs to compare INT8 with FP32 on, as --calibration (default: the calibration samples)",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="auto",
        help="static (calibrated), dynamic, or auto: static when there are samples (default %(default)s)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="qdq",
        help="static quantization's graph: QuantizeLinear/DequantizeLinear pairs (qdq) or QLinear operators "
        "(qoperator) (default %(default)s)",
    )
    parser.add_argument(
        "--per-tensor",
        action="store_true",
        help="one scale per weight tensor instead of one per output channel",
    )
    parser.add_argument(
        "--reduce-range",
        action="store_true",
        help="7-bit weights, for CPUs without VNNI (AVX2, AVX-512 without VNNI) where 8 bits can saturate",
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="the batch the speed is measured at (default %(default)s)"
    )


def run_quantize_command(args: argparse.Namespace) -> int:
    """Quantize, print the report; 1 with the reason when the model cannot be quantized."""
    try:
        options = QuantizeSettings(
            method=args.method,
            format=args.format,
            per_channel=not args.per_tensor,
            reduce_range=args.reduce_range,
            calibration=args.calibration,
            evaluation=args.evaluation,
            version=args.version,
            batch_size=args.batch_size,
        )
        report = quantize(args.model_dir, args.model, options)
    except (RepositoryError, ValueError) as exc:
        print(f"pipeline quantize: {getattr(exc, 'message', exc)}")
        return 1
    print(report.text())
    return 0

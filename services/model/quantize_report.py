"""How `pipeline quantize`'s INT8 file compares with its FP32 one: per output, its agreement and largest
difference on the same inputs, and each file's CPU time per batch in ONNX Runtime; the report that says so,
and the rule that refuses a version that disagrees."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.protocol.errors import RepositoryError
from services.model.quantize_samples import batches, count

log = logging.getLogger(__name__)

#: Timed rounds of each file (the best counts).
ROUNDS = 5
#: An item of an output that does not score classes agrees where each of its values is within this share of
#: the output's FP32 spread (largest minus smallest over the compared inputs) of FP32's value.
TOLERANCE = 0.05
#: The least agreement with FP32, on every output, of a version `quantize` writes unless forced: one item in
#: 50 may differ (one in 64 random inputs near a class boundary), a saturating kernel's many may not.
MIN_AGREEMENT = 0.98


#: A dynamically quantized file less than this many times smaller than FP32 had next to nothing quantized
#: (everything quantized: about 4x).
LITTLE_SHRINK = 2.0


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
    #: Weights in 7 bits rather than 8.
    reduce_range: bool
    #: Why: the flag that said so, or what this CPU's 8-bit kernels do.
    reduce_range_reason: str
    #: Where the calibration samples came from, and how many ("" for dynamic quantization).
    calibration: str
    #: Where the compared inputs came from, and how many.
    evaluated_on: str
    #: Per output: the share of items that agree with the FP32 file's (top-1 where the output scores classes,
    #: else every value within `TOLERANCE` of the output's spread).
    agreement: dict[str, float] = field(default_factory=dict)
    #: Per output that scores classes: the fraction of items whose top-1 (argmax over the last axis) is the FP32
    #: file's.
    top1_agreement: dict[str, float] = field(default_factory=dict)
    #: Per output: the largest absolute difference from the FP32 file's.
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    #: The least agreement a version needs to be written unless forced.
    min_agreement: float = MIN_AGREEMENT
    #: Written though an output's agreement is below `min_agreement` (`--force`).
    forced: bool = False
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

    def disagreeing(self) -> dict[str, float]:
        """The outputs whose agreement is below `min_agreement`, with it."""
        return {name: share for name, share in self.agreement.items() if share < self.min_agreement}

    def text(self) -> str:
        """The report for people."""
        lines = [
            f"model '{self.model}' version {self.source_version} -> version {self.version} (INT8): {self.path}",
            f"  {self.method} quantization"
            + (f", {self.format.upper()}" if self.method == "static" else "")
            + f", weights per {'channel' if self.per_channel else 'tensor'} in "
            + f"{7 if self.reduce_range else 8} bits ({self.reduce_range_reason})"
            + (f"; calibrated on {self.calibration}" if self.calibration else ""),
            f"  size: {self.fp32_bytes / 1e6:.2f} MB FP32 -> {self.int8_bytes / 1e6:.2f} MB INT8; operators: "
            + ", ".join(f"{op} x{n}" for op, n in self.operators.items()),
            f"  compared on {self.evaluated_on}:",
        ]
        for name, diff in self.max_abs_diff.items():
            kind = "top-1" if name in self.top1_agreement else f"within {TOLERANCE:.0%} of the spread"
            lines.append(
                f"    {name}: agreement {self.agreement[name]:.2%} ({kind}), max abs difference {diff:.4g}"
            )
        shrunk = self.fp32_bytes / max(self.int8_bytes, 1)
        if self.method == "dynamic" and shrunk < LITTLE_SHRINK:
            lines.append(
                f"  note: next to nothing was quantized ({shrunk:.2f}x smaller): without calibration samples, "
                "dynamic quantization takes only MatMul, Gemm, attention, LSTM and GRU, not convolutions; "
                "give samples for static quantization of the whole model: --calibration FILE (.npy, or .npz "
                "by input name, batch first), or model_warmup samples with data in its config.pbtxt"
            )
        if self.forced:
            lines.append(f"  written by --force: agreement below {self.min_agreement:.2%}")
        if self.fp32 and self.int8:
            lines.append(
                f"  CPU per batch of {self.batch_size} (ONNX Runtime, 1 thread, best of {ROUNDS} rounds): FP32 "
                f"{self.fp32.cpu_ms_per_batch:.3f} ms, INT8 {self.int8.cpu_ms_per_batch:.3f} ms "
                f"({self.cpu_speedup:.2f}x)"
            )
        return "\n".join(lines)


def check_agreement(report: Report, force: bool, hint: str = "") -> None:
    """Refuse to write a version that disagrees with FP32 on any output, naming the figures (and `hint`, what
    may help), unless `force` (the report then says so)."""
    below = report.disagreeing()
    if not below:
        return
    if force:
        report.forced = True
        log.warning(
            "writing version %s by --force: its agreement with FP32 is below %.2f%%",
            report.version,
            100 * report.min_agreement,
        )
        return
    figures = ", ".join(f"'{name}' {share:.2%}" for name, share in below.items())
    raise RepositoryError(
        f"model '{report.model}': the INT8 version agrees with FP32 on {report.evaluated_on} below "
        f"--min-agreement {report.min_agreement:.2%}: {figures}; version {report.version} not written "
        f"({hint + '; ' if hint else ''}--force writes it anyway)"
    )


def compare_outputs(
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
        report.agreement[output] = report.top1_agreement.get(output, _close_share(a, b))


def _close_share(expected: np.ndarray, got: np.ndarray) -> float:
    """The share of items (along the first axis) whose every value is within `TOLERANCE` of the expected
    output's spread of the expected value; integers must be equal."""
    if not expected.size:
        return 1.0
    items = len(expected) if expected.ndim else 1
    a = expected.astype(np.float64).reshape(items, -1)
    b = got.astype(np.float64).reshape(items, -1)
    allowed = TOLERANCE * float(a.max() - a.min()) if expected.dtype.kind == "f" else 0.0
    return float(np.mean(np.all(np.abs(a - b) <= allowed, axis=1)))


def _run_all(
    session: Any, samples: Mapping[str, np.ndarray], names: list[str], batch: int
) -> dict[str, np.ndarray]:
    """Every sample through `session`, outputs stacked by name."""
    feeds = [i.name for i in session.get_inputs()]
    batching = len(session.get_inputs()[0].shape) > 0 and count(samples) > 0
    results: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for inputs in batches(samples, batch, batching):
        produced = session.run(names, {k: v for k, v in inputs.items() if k in feeds})
        for name, array in zip(names, produced, strict=True):
            results[name].append(array)
    return {n: np.concatenate(arrays) for n, arrays in results.items()}


def timings(
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

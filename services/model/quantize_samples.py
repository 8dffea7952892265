"""The samples `pipeline quantize` calibrates on and compares on: a `.npy` or `.npz` file the user gives, a
model's `model_warmup` samples that carry data, or random inputs; and those samples in batches."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from pipeline.protocol.datatypes import DATATYPES
from pipeline.protocol.errors import RepositoryError
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.repository import RepositoryEntry
from pipeline.stage.warmup import warmup_samples
from services.model.artifacts import first_line
from services.model.backend import ModelFile

#: Inputs compared when no file gives them (random, from a fixed seed).
RANDOM_SAMPLES = 64


def count(samples: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(samples.values()))) if samples else 0


def calibration_samples(
    entry: RepositoryEntry, model: ModelFile, inputs: Sequence[TensorSpec], path: Path | None
) -> tuple[dict[str, np.ndarray], str]:
    """The calibration samples by input name (batch first), and where they came from: the file at `path`,
    else the model's `model_warmup` samples that carry data (none: empty)."""
    if path is not None:
        samples = read_samples(path, inputs, model.config.max_batch_size)
        return samples, f"{path} ({count(samples)} samples)"
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
    return dict(merged), f"model_warmup {names} ({count(merged)} samples)"


def evaluation_samples(
    path: Path | None,
    inputs: Sequence[TensorSpec],
    max_batch_size: int,
    calibration: dict[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], str]:
    """The samples the two versions are compared on, and what they are: the file at `path` (`--evaluation`), else the
    calibration samples, else random inputs."""
    if path is not None:
        evaluation = read_samples(path, inputs, max_batch_size)
        return evaluation, f"{path} ({count(evaluation)} samples)"
    if calibration:
        return calibration, f"the calibration samples ({count(calibration)})"
    evaluation = random_inputs(inputs, max_batch_size)
    return evaluation, f"{count(evaluation)} random inputs (closeness, not accuracy)"


def read_samples(path: Path, inputs: Sequence[TensorSpec], max_batch_size: int) -> dict[str, np.ndarray]:
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


def random_inputs(inputs: Sequence[TensorSpec], max_batch_size: int) -> dict[str, np.ndarray]:
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


def batches(samples: Mapping[str, np.ndarray], batch: int, batching: bool) -> Iterator[dict[str, np.ndarray]]:
    """The samples in batches of `batch` (one at a time, without the sample axis, for a model that does not
    batch)."""
    total = count(samples)
    if not batching:
        for i in range(total):
            yield {k: v[i] for k, v in samples.items()}
        return
    for start in range(0, total, batch):
        yield {k: v[start : start + batch] for k, v in samples.items()}


def batch_feeds(samples: Mapping[str, np.ndarray], batch: int, batching: bool) -> dict[str, np.ndarray]:
    """One batch of `batch` items for timing (the samples repeated if there are fewer)."""
    if not batching:
        return {k: v[0] for k, v in samples.items()}
    reps = -(-batch // count(samples))
    return {k: np.concatenate([v] * reps)[:batch] for k, v in samples.items()}

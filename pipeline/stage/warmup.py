"""Triton's `model_warmup`: sample requests that every instance of a version runs before the version is
reported ready, so that the first user request does not pay for lazy initialisation (allocations, kernel
selection, caches).

Each sample of the config names its `batch_size` and, per input, `data_type`, `dims` (without the batch
dimension) and its data: `zero_data`, `random_data` (seeded: every load warms up alike) or `input_data_file`,
a file of the model's `warmup/` folder holding the raw row-major bytes of one item (a BYTES element is a
4-byte little-endian length and its bytes). A BYTES input's zero or random data is empty strings. The item
is repeated `batch_size` times for a model that batches; a model that does not takes `batch_size` 1. Each
sample runs `count` times (at least once) on every instance; on a decoupled model, as a streamed request: its
responses are read up to the final one.

A sample is checked as a request would be (names, datatypes, shapes against the model's inputs) when the
version is prepared, and a sample that fails on an instance refuses the version with its reason: a model
that cannot answer its own warm-up would not answer users either.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.codec import Tensor, validate_inputs
from pipeline.protocol.datatypes import DATATYPES, array_from_raw
from pipeline.protocol.errors import InvalidInput, PipelineError, RepositoryError, StageError
from pipeline.protocol.model_config import datatype_of_config
from pipeline.protocol.types import TensorSpec
from pipeline.stage.api import NO_DEADLINE, Deadline
from pipeline.stage.decoupled import ResponseChannel
from pipeline.stage.pool import InstancePool, Slot

log = logging.getLogger(__name__)

#: The folder of a model, beside its version folders, that holds the `input_data_file`s of its samples.
WARMUP_FOLDER = "warmup"
#: Seed of `random_data`.
_SEED = 0


@dataclass(frozen=True)
class WarmupSample:
    """One sample of `model_warmup`, ready to run: its name, its input arrays, how many runs it gets, and
    whether its model is decoupled (the sample then runs as a streamed request)."""

    name: str
    inputs: dict[str, np.ndarray]
    count: int
    decoupled: bool = False


def warmup_samples(
    config: mc.ModelConfig, inputs: Sequence[TensorSpec], folder: Path, source: str
) -> list[WarmupSample]:
    """The samples of a version's config, built and checked; `RepositoryError` naming the sample otherwise."""
    samples = []
    decoupled = config.model_transaction_policy.decoupled
    for index, warmup in enumerate(config.model_warmup):
        name = warmup.name or f"#{index}"
        where = f"{source}: model_warmup '{name}'"
        batch = warmup.batch_size
        if batch < 1:
            raise RepositoryError(f"{where}: batch_size must be at least 1, got {batch}")
        if config.max_batch_size == 0 and batch != 1:
            raise RepositoryError(
                f"{where}: the model does not batch (max_batch_size 0), so batch_size must be 1"
            )
        tensors = [
            Tensor.from_array(
                input_name, _batch_of(_item(spec, folder, f"{where}, input '{input_name}'"), batch, config)
            )
            for input_name, spec in sorted(warmup.inputs.items())
        ]
        try:
            checked = validate_inputs(config.name, tensors, inputs, config.max_batch_size)
        except InvalidInput as exc:
            raise RepositoryError(f"{where}: {exc.message}") from None
        arrays = {input_name: tensor.to_array() for input_name, tensor in checked.items()}
        samples.append(WarmupSample(name, arrays, max(warmup.count, 1), decoupled))
    return samples


def _item(spec: mc.ModelWarmup.Input, folder: Path, where: str) -> np.ndarray:
    """One item of a sample's input, as its data says."""
    try:
        datatype = datatype_of_config(spec.data_type)
    except ValueError:
        raise RepositoryError(f"{where}: data_type is not set") from None
    dims = tuple(spec.dims)
    if any(d < 0 for d in dims):
        raise RepositoryError(f"{where}: dims {list(dims)} must be fixed (no -1) in a warm-up sample")
    kind = spec.WhichOneof("input_data_type")
    if kind is None:
        raise RepositoryError(f"{where}: no data: set zero_data, random_data or input_data_file")
    if datatype == "BYTES" and kind != "input_data_file":
        item = np.empty(dims, dtype=object)
        item.fill(b"")
        return item
    dtype = DATATYPES[datatype]
    if kind == "zero_data":
        return np.zeros(dims, dtype)
    if kind == "random_data":
        rng = np.random.default_rng(_SEED)
        if dtype.kind == "f":
            return rng.random(dims).astype(dtype)
        if dtype.kind == "b":
            return rng.integers(0, 2, dims).astype(dtype)
        return rng.integers(0, 100, dims).astype(dtype)  # small values: valid for every integer type
    return _from_file(folder, spec.input_data_file, datatype, dims, where)


def _from_file(folder: Path, file_name: str, datatype: str, dims: tuple[int, ...], where: str) -> np.ndarray:
    base = (folder / WARMUP_FOLDER).resolve()
    path = (base / file_name).resolve()
    if not path.is_relative_to(base) or path == base:
        raise RepositoryError(
            f"{where}: input_data_file {file_name!r} is not a file inside the model's {WARMUP_FOLDER}/ folder"
        )
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RepositoryError(f"{where}: cannot read input_data_file {path}: {exc.strerror or exc}") from None
    try:
        return array_from_raw(datatype, dims, raw, file_name)
    except InvalidInput as exc:
        raise RepositoryError(f"{where}: input_data_file {path}: {exc.message}") from None


def _batch_of(item: np.ndarray, batch: int, config: mc.ModelConfig) -> np.ndarray:
    """The sample's input as the model takes it: `batch` copies of the item for a model that batches."""
    if config.max_batch_size == 0:
        return item
    return np.repeat(item[np.newaxis], batch, axis=0)


async def warm_up(pool: InstancePool, samples: Sequence[WarmupSample], label: str) -> None:
    """Run every sample `count` times on every instance of `pool` (the instances side by side); the first
    failure is raised as `RepositoryError` naming the sample and the instance. A decoupled model's sample runs
    as a streamed request does: every response read up to the final flag, an error response its failure."""
    if not samples:
        return

    async def one(index: int) -> None:
        slot = pool.slots[index]
        for sample in samples:
            for _ in range(sample.count):
                try:
                    if sample.decoupled:
                        await _run_decoupled(slot, sample.inputs)
                    elif slot.on_loop:
                        await slot.execute(sample.inputs, NO_DEADLINE)
                    else:
                        await slot.call(slot.instance.run, sample.inputs, NO_DEADLINE)
                except Exception as exc:
                    reason = exc.message if isinstance(exc, PipelineError) else f"{type(exc).__name__}: {exc}"
                    raise RepositoryError(
                        f"{label}: model_warmup '{sample.name}' failed on instance {index}: {reason}"
                    ) from None

    outcomes = await asyncio.gather(*(one(index) for index in range(len(pool.slots))), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    runs = sum(sample.count for sample in samples)
    log.info("%s: warmed up each of %d instance(s) with %d run(s)", label, len(pool.slots), runs)


async def _run_decoupled(slot: Slot, inputs: dict[str, np.ndarray]) -> None:
    """One sample on a decoupled instance: its responses read up to the final one (a Triton model may send
    them after its `execute` returned), and the model's call returned, so the instance is free again."""
    # NOTE: a deadline of its own, never the shared NO_DEADLINE: closing the channel marks its deadline
    # cancelled, which stops a model that still sends.
    deadline = Deadline()
    channel = ResponseChannel(asyncio.get_running_loop(), deadline)
    running = asyncio.ensure_future(slot.call(slot.run_decoupled, inputs, deadline, channel))

    def returned(future: asyncio.Future[None]) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            channel.fail(
                error
                if isinstance(error, PipelineError)
                else StageError(f"{type(error).__name__}: {error}", grpc.StatusCode.INTERNAL)
            )

    running.add_done_callback(returned)
    try:
        while True:
            _, error, final = await channel.get()
            if error is not None:
                raise error
            if final:
                break
        await running
    finally:
        channel.close()

"""Backends: what turns a repository entry into something the stage runtime can serve.

A stage service serves the repository entries whose backend it runs. For each version it serves, its
`Backend` reads the artifact, completes and checks the config (Triton's auto-complete), and hands back a
`PreparedVersion`: the config clients will read through `ModelConfig`, and one unloaded `Instance` per
instance of Triton's `instance_group`. The runtime (`pipeline.stage.stage_plane.StagePlane`) loads the
instances (each on a thread of its own), routes requests to an idle one, and swaps versions in and out
(`RepositoryModelLoad` / `RepositoryModelUnload`).

`StageInstance` adapts a `pipeline.stage.api.Stage` object to an instance, and `stage_config` describes it as a
`ModelConfig`: the python backend and in-process test servers both use them.

A decoupled instance (its config's `model_transaction_policy { decoupled: true }`, `pipeline.stage.decoupled`)
also has `run_decoupled`, which hands each response to a `ResponseSink` as it is made instead of returning one.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import PipelineError
from pipeline.protocol.model_config import (
    DETERMINISTIC_PARAMETER,
    check_response_cache,
    set_tensor_specs,
)
from pipeline.runtime.repository import BACKEND_PLATFORMS, RepositoryEntry
from pipeline.stage.api import NO_DEADLINE, Deadline, Stage


@runtime_checkable
class Instance(Protocol):
    """One instance of one model version. `load`, `run` and `unload` block; the runtime calls them on the
    instance's own thread (never two at once), or on the event loop for an `inline` instance."""

    #: Where it runs: "cpu", "cuda:0", ...
    device: str
    #: Why this backend and device were chosen (logged, and shown in `ModelConfig.parameters`).
    reason: str
    #: Run on the event loop instead of a thread: only for work of microseconds (see `Stage.inline`).
    inline: bool
    #: Where it is its version's only instance, run batches that have lately been brief on the event loop
    #: too (`pipeline.stage.pool.BRIEF_S`): for compute that never waits on the request (no deadline polling).
    inline_when_brief: bool

    def load(self) -> None:
        """Read weights, build, warm up. Raise `pipeline.protocol.errors.RepositoryError` for a bad artifact."""
        ...

    def run(
        self, inputs: Mapping[str, np.ndarray], deadline: Deadline = NO_DEADLINE
    ) -> dict[str, np.ndarray]:
        """One batch: every input the request carries in, by its config name; every output out. `deadline`
        is the call's: work that goes item by item may stop once it has expired (`DeadlineExceeded`)."""
        ...

    def unload(self) -> None:
        """Release what `load` acquired."""
        ...


class ResponseSink(Protocol):
    """Where a decoupled instance's responses go (`pipeline.stage.decoupled.ResponseChannel`)."""

    def send(
        self,
        outputs: Mapping[str, np.ndarray] | None,
        error: PipelineError | None = None,
        final: bool = False,
    ) -> bool:
        """Hand over one response (`outputs`, or `error`; neither: the final flag alone), waiting while the
        client has not read those before it; False once nobody reads them (the response is dropped)."""
        ...

    def cancelled(self) -> bool:
        """Whether the request's client has gone or its deadline has passed."""
        ...


def is_generator_stage(stage: Stage) -> bool:
    """Whether a stage's `infer` is a generator or an async generator: the stage is decoupled."""
    infer = type(stage).infer
    return inspect.isgeneratorfunction(infer) or inspect.isasyncgenfunction(infer)


@dataclass
class PreparedVersion:
    """One version of a model, ready to load."""

    #: The completed config as `ModelConfig` returns it: name, platform, backend, max_batch_size, input and
    #: output, instance_group as placed, version_policy, dynamic_batching, parameters...
    config: mc.ModelConfig
    #: One per instance, not loaded yet; at least one.
    instances: list[Instance] = field(default_factory=list)


class Backend(Protocol):
    """Prepares the versions of the repository entries whose backend is in `names`."""

    #: The repository backends it runs: e.g. ("onnxruntime", "pytorch", "tensorrt"), or ("python",).
    names: tuple[str, ...]

    def prepare(self, entry: RepositoryEntry, version: str) -> PreparedVersion:
        """Read the version's artifact, complete the config from it where the config is silent (Triton's
        auto-complete), check that they agree, and create the instances. Blocking (the runtime calls it on
        a worker thread). Raises `RepositoryError` naming the file and the cause."""
        ...


def stage_config(stage: Stage, name: str | None = None) -> mc.ModelConfig:
    """A `Stage`'s declarations as a `ModelConfig` (one CPU instance)."""
    model = name or stage.name
    config = mc.ModelConfig(
        name=model,
        platform=stage.platform or BACKEND_PLATFORMS["python"],
        backend=stage.backend,
        max_batch_size=stage.max_batch_size,
    )
    set_tensor_specs(config, stage.inputs, stage.outputs)
    if is_generator_stage(stage):
        config.model_transaction_policy.decoupled = True
    if not stage.deterministic:
        config.parameters[DETERMINISTIC_PARAMETER].string_value = "false"
    if stage.response_cache:
        config.response_cache.enable = True
        check_response_cache(config, f"stage '{model}'")
    config.instance_group.add(name=f"{model}_0", count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    return config


class StageInstance:
    """A `Stage` object as an instance: its `load`, `infer` and `unload`. A stage whose `infer` is a
    generator is decoupled: each of its yields is a response, and its end the final flag."""

    device = "cpu"
    #: A stage's own code may wait on its request (`Stage.expired()`): it says for itself (`Stage.inline`).
    inline_when_brief = False

    def __init__(self, stage: Stage, reason: str = "python stage") -> None:
        self.stage = stage
        self.reason = reason
        # NOTE: a generator's responses wait for their client in `ResponseSink.send`: never on the event loop.
        self.inline = bool(stage.inline) and not is_generator_stage(stage)

    def load(self) -> None:
        self.stage.load()

    def run(
        self, inputs: Mapping[str, np.ndarray], deadline: Deadline = NO_DEADLINE
    ) -> dict[str, np.ndarray]:
        # NOTE: an instance runs one call at a time, so the stage's `deadline` is this call's while it runs.
        self.stage.deadline = deadline
        try:
            return self.stage.infer(inputs)
        finally:
            self.stage.deadline = NO_DEADLINE

    def run_decoupled(self, inputs: Mapping[str, np.ndarray], deadline: Deadline, sink: ResponseSink) -> None:
        """Run a generator stage to its end, or until its client has gone: then it is closed at the yield
        whose response nobody reads (within one response). An async generator runs on this thread's own loop."""
        self.stage.deadline = deadline
        try:
            produced = self.stage.infer(inputs)
            if inspect.isasyncgen(produced):
                asyncio.run(_drain_async(produced, sink))
            else:
                _drain(produced, sink)  # type: ignore[arg-type]
        finally:
            self.stage.deadline = NO_DEADLINE
        sink.send(None, None, True)

    def unload(self) -> None:
        self.stage.unload()


def _drain(produced: Iterator[Mapping[str, np.ndarray]], sink: ResponseSink) -> None:
    with contextlib.closing(produced):  # type: ignore[type-var]
        for outputs in produced:
            if not sink.send(outputs):
                return


async def _drain_async(produced: AsyncIterator[Mapping[str, np.ndarray]], sink: ResponseSink) -> None:
    async with contextlib.aclosing(produced):  # type: ignore[type-var]
        async for outputs in produced:
            if not sink.send(outputs):
                return

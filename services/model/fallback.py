"""A fallback that falls back: an instance that tries its runners in order until one loads the model.

`services.model.backend.choose_runner` orders the runners that could run an instance (TensorRT, then ONNX
Runtime with the CUDA provider, then PyTorch on CUDA, then the CPU). Which of them can is often known only by
trying: TensorRT may reject an operator or fail to build an engine, an ONNX export may not know an operator, a
GPU may run out of memory. `FallbackInstance.load` tries each in turn; when one fails, it logs a warning
naming the runner and why, and the next takes the model. The reason of the one that loads says what was
passed over and why, and `on_loaded` tells the backend, which shows it in the model's config.

Strict models (`strict_runner`) get a chain of one: the first failure fails the load.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from pipeline.protocol.errors import RepositoryError
from pipeline.stage.api import NO_DEADLINE, Deadline
from services.model.artifacts import first_line
from services.model.instances import ArtifactInstance

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Choice:
    """One runner an instance may run on: "onnxruntime", "torch" or "tensorrt", its device, and why."""

    runner: str
    device: str
    reason: str

    @property
    def label(self) -> str:
        """ "onnxruntime on cpu", "tensorrt on cuda:0"..."""
        return f"{self.runner} on {self.device}"


class FallbackInstance:
    """One instance of a model file, run by the first of `choices` that loads it.

    Args:
        choices: the runners in order of preference (at least one).
        build: makes the (unloaded) instance of one choice.
        on_loaded: called with the choice that loaded, its reason updated with what failed before it.
        source: the model file, for messages.
    """

    inline = False
    inline_when_brief = True

    def __init__(
        self,
        choices: list[Choice],
        build: Callable[[Choice], ArtifactInstance],
        *,
        on_loaded: Callable[[Choice], None] = lambda _: None,
        source: str = "",
    ) -> None:
        if not choices:
            raise ValueError("a FallbackInstance needs at least one choice")
        self.choices = choices
        self._build = build
        self._on_loaded = on_loaded
        self.source = source
        self.instance: ArtifactInstance | None = None
        self._choose(choices[0])

    def _choose(self, choice: Choice) -> None:
        self.chosen = choice
        #: The runner, device and reason of the choice that loaded (before loading, of the first).
        self.runner, self.device, self.reason = choice.runner, choice.device, choice.reason

    def load(self) -> None:
        """Load with each choice in turn until one loads; `RepositoryError` naming every failure when none
        does."""
        failures: list[str] = []
        for index, choice in enumerate(self.choices):
            if failures:
                choice = replace(choice, reason=f"{choice.reason}; fell back: {'; '.join(failures)}")
            instance = self._build(choice)
            try:
                instance.load()
            except Exception as exc:
                with contextlib.suppress(Exception):
                    instance.unload()
                why = exc.message if isinstance(exc, RepositoryError) else first_line(exc)
                failures.append(f"{choice.label} failed: {why}")
                if index + 1 == len(self.choices):
                    if len(self.choices) == 1 and isinstance(exc, RepositoryError):
                        raise
                    raise RepositoryError(
                        f"{self.source}: no runner could load it: {'; '.join(failures)}"
                    ) from None
                log.warning(
                    "%s: %s cannot load it (%s); falling back to %s",
                    self.source,
                    choice.label,
                    why,
                    self.choices[index + 1].label,
                )
                continue
            self.instance = instance
            self._choose(choice)
            self._on_loaded(choice)
            return

    def run(
        self, inputs: Mapping[str, np.ndarray], deadline: Deadline = NO_DEADLINE
    ) -> dict[str, np.ndarray]:
        """One batch on the runner that loaded."""
        if self.instance is None:
            raise RuntimeError("FallbackInstance.run called before load()")
        return self.instance.run(inputs, deadline)

    def unload(self) -> None:
        """Unload the runner that loaded."""
        if self.instance is not None:
            self.instance.unload()
            self.instance = None

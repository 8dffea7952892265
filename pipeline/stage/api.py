"""What a stage model is: named, typed tensors in and out, and batch inference on numpy arrays.

A stage is a `Stage` subclass in a model repository's `<model>/<version>/model.py`, which the stage
services serve through the python backend (`pipeline.stage.python_backend`), or a `Stage` object handed to
`pipeline.stage.service.serve_stages` directly; the runtime does the protocol, validation, health and errors.

From a repository, the model is named after its folder, and an optional `config.pbtxt` beside the version
folders may declare the tensors, `max_batch_size` and `instance_group` (see `pipeline.stage.python_backend`).
Its `parameters` reach the stage as `Stage.parameters`, plain strings set before `load()`:

    parameters { key: "max_image_pixels" value { string_value: "1000000" } }

    class Digits(Stage):
        def load(self) -> None:
            self.max_image_pixels = int(self.parameters.get("max_image_pixels", "16000000"))

`load` is where a stage reads them: an error raised there refuses the model with a message naming the
`model.py`, and the service goes on serving its other models.

A stage that works item by item on a big batch checks `self.expired()` between items: it turns true once
the call's deadline (the client's gRPC deadline) has passed or its caller has gone, and the stage then
raises `DeadlineExceeded` instead of finishing work nobody will read.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import numpy as np

from pipeline.protocol.types import TensorSpec


class Deadline:
    """When one call must be answered by, and whether its caller has gone.

    `at` is a time on `clock` (`time.monotonic` unless a test gives its own), None for a call without a
    deadline. The event loop marks a call `cancelled` when its caller goes away; the instance's thread reads
    it (a plain attribute: one writer, and a late read only costs one more item)."""

    __slots__ = ("at", "cancelled", "clock")

    def __init__(self, at: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.at = at
        self.clock = clock
        self.cancelled = False

    @classmethod
    def after(cls, timeout: float | None, clock: Callable[[], float] = time.monotonic) -> Deadline:
        """The deadline `timeout` seconds from now (None: none)."""
        return cls(None if timeout is None else clock() + timeout, clock)

    def expired(self) -> bool:
        """Whether the call's answer is no longer wanted: its deadline passed, or its caller went away."""
        return self.cancelled or (self.at is not None and self.clock() >= self.at)

    def remaining(self) -> float | None:
        """Seconds left (None: no deadline; never below 0)."""
        return None if self.at is None else max(0.0, self.at - self.clock())


#: The deadline of a call that has none (what a stage sees outside a call).
NO_DEADLINE = Deadline()


class Stage(abc.ABC):
    """A model served by a stage service.

    Subclasses set the class attributes (or instance attributes in `__init__`) and implement `infer`.
    `load` and `infer` are blocking and run in the model's own executor thread, never on the event loop
    (unless the stage declares itself `inline`).
    """

    #: The model name clients and ensemble steps use.
    name: str
    #: Inputs and outputs, in the order `ModelMetadata` lists them.
    inputs: Sequence[TensorSpec]
    outputs: Sequence[TensorSpec]
    #: Largest batch (dimension 0) one `infer` call accepts; 0 means the model does not batch.
    max_batch_size: int = 0
    #: What `ModelMetadata.platform` and `ModelConfig.platform` report.
    platform: str = "python"
    #: What `ModelConfig.backend` reports.
    backend: str = "python"
    #: The versions served; the last is the default.
    versions: Sequence[str] = ("1",)
    #: Run `infer` on the event loop instead of the model's thread. Only for work of microseconds (small
    #: numpy arithmetic), where two thread hand-offs per call would cost more than the work itself; anything
    #: that can take longer must leave it False, or it stalls every other request of the process.
    inline: bool = False
    #: False for a model whose answer to the same request may differ (sampling, a clock, state): published in
    #: its `ModelConfig` as parameter `deterministic: "false"`, so that its responses are never cached.
    deterministic: bool = True
    #: Ask the router to cache this model's responses (Triton's `response_cache { enable: true }`, which a
    #: `config.pbtxt` may set instead; the router's `--cache-size` bounds the cache).
    response_cache: bool = False
    #: The `parameters` of the model's `config.pbtxt` (string values), set before `load()` when the stage is
    #: served from a repository; empty otherwise.
    parameters: Mapping[str, str] = MappingProxyType({})
    #: The deadline of the call being run, set by the runtime before each `infer` (`NO_DEADLINE` outside one).
    deadline: Deadline = NO_DEADLINE

    def expired(self) -> bool:
        """Whether the call being run is past its deadline or its caller has gone: a cheap check (a clock
        read) for a stage to make between the items of a batch, then raising `DeadlineExceeded`."""
        return self.deadline.expired()

    def load(self) -> None:  # noqa: B027 - loading is optional
        """Prepare the model (read weights, warm up). Health turns SERVING only after every load returns."""

    def unload(self) -> None:  # noqa: B027 - unloading is optional
        """Release what `load` acquired."""

    @abc.abstractmethod
    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch.

        `inputs` maps every declared input name to an array of the declared datatype (BYTES arrive as an
        object array of `bytes`), already checked against the declared shape. Return an array for every
        declared output, with the same dimension-0 size as the inputs when the model batches. Raise
        `pipeline.stage.InvalidInput` naming the input and the batch index for content that cannot be used.
        """

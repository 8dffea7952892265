"""Plain value types every layer shares: a tensor's declaration and a model's batching settings."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.protocol.datatypes import DATATYPES


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor a model takes or gives.

    `shape` is the whole shape as clients see it in `ModelMetadata`: -1 marks a variable dimension, and for a
    model that batches (`max_batch_size > 0`) dimension 0 is the batch dimension and is -1.

    `pad_value` lets the router's batcher put requests whose variable (non-batch) dimensions differ into one
    batch: on an input, those dimensions are padded to the batch's largest with this value (give the model a
    way to see the true lengths, such as an attention mask that is padded with 0); on an output, it says the
    output's variable dimensions follow the padded inputs, so each request gets back only its own extent.
    Without it, requests of different shapes are batched separately.

    `optional` (inputs only, Triton's `optional: true`) lets a request leave the input out.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    pad_value: float | None = None
    optional: bool = False

    def __post_init__(self) -> None:
        if self.datatype not in DATATYPES:
            raise ValueError(f"tensor {self.name!r}: unknown datatype {self.datatype!r}")
        if any(d < -1 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: dimensions must be -1 or >= 0, got {list(self.shape)}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    """Triton's `dynamic_batching` settings for one stage model (times in microseconds)."""

    #: The largest batch sent to the stage.
    max_batch_size: int = 64
    #: How long the first request of a batch may wait for others.
    max_queue_delay_microseconds: int = 1000
    #: Batch sizes to send as soon as they are reached.
    preferred_batch_size: tuple[int, ...] = ()
    #: Requests that may wait at once; a request beyond it is refused with UNAVAILABLE. 0 = no limit.
    max_queue_size: int = 1024
    #: A request's time limit in the queue when it brings none; 0 = none.
    default_timeout_microseconds: int = 0
    #: Whether the request parameter `timeout` (µs) may shorten or lengthen the default.
    allow_timeout_override: bool = True
    #: 0 = one level. Otherwise requests carry the parameter `priority`, 1 (highest) .. priority_levels.
    priority_levels: int = 0
    #: The level of a request that names none (or one out of range).
    default_priority_level: int = 0
    #: Complete requests in the order they arrived, even when a later batch finishes first.
    preserve_ordering: bool = False
    #: How many batches may be in flight at once to each ready replica of the stage (with 3 replicas
    #: serving and 1 here, 3 batches are in flight).
    max_inflight_batches: int = 1
    #: When no batch is in flight, send all that is queued (up to max_batch_size) at once instead of
    #: waiting out the delay. While batches are in flight, a free slot waits for the largest preferred
    #: size or the delay.
    idle_dispatch: bool = True
    #: When idle, still wait (never past the delay) while requests that the router already holds are on
    #: their way here, until the queue reaches the largest preferred size (else max_batch_size) or they
    #: have all come. A lone request never waits; under load the batches grow.
    batch_upcoming: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        for size in self.preferred_batch_size:
            if not 1 <= size <= self.max_batch_size:
                raise ValueError(
                    f"preferred_batch_size {size} is outside 1..max_batch_size ({self.max_batch_size})"
                )
        if self.max_inflight_batches < 1:
            raise ValueError(f"max_inflight_batches must be >= 1, got {self.max_inflight_batches}")
        if self.priority_levels and not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(
                f"default_priority_level must be in 1..{self.priority_levels}, got {self.default_priority_level}"
            )

    @property
    def max_delay(self) -> float:
        return self.max_queue_delay_microseconds / 1e6

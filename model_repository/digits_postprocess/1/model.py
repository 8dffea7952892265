"""`digits_postprocess`: logits → the most likely class and the probability of every class."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline.stage import InvalidInput, ItemError, Stage, TensorSpec

#: The digits: 0 to 9.
NUM_CLASSES = 10


def check_finite(logits: np.ndarray, name: str = "LOGITS") -> np.ndarray:
    """Return `logits` if every row is finite; otherwise refuse every bad row, naming each index."""
    finite = np.isfinite(logits).all(axis=1)
    if not finite.all():
        raise InvalidInput.for_items(
            [
                ItemError(name, int(index), f"logits must be finite, got {logits[index].tolist()}")
                for index in np.flatnonzero(~finite)
            ]
        )
    return logits


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of a float [N, C] array, in float32.

    Subtracting each row's maximum first keeps `exp` from overflowing; the result is the same.
    """
    shifted = logits.astype(np.float32, copy=True)
    # A logit so far below the row's maximum that the difference overflows to -inf has probability 0,
    # which is what exp(-inf) gives: the overflow is harmless.
    with np.errstate(over="ignore"):
        shifted -= shifted.max(axis=1, keepdims=True)
    np.exp(shifted, out=shifted)
    shifted /= shifted.sum(axis=1, keepdims=True)
    return shifted


class ClassifyStage(Stage):
    """Turns `LOGITS` [N, 10] into `LABEL` [N, 1] (argmax, INT64) and `SCORES` [N, 10] (softmax, FP32)."""

    inline = True  # a few microseconds of numpy per call

    max_batch_size = 256
    inputs = (TensorSpec("LOGITS", "FP32", (-1, NUM_CLASSES)),)
    outputs = (
        TensorSpec("LABEL", "INT64", (-1, 1)),
        TensorSpec("SCORES", "FP32", (-1, NUM_CLASSES)),
    )

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Classify a batch; a row with NaN or infinite logits is refused, naming its index."""
        logits = check_finite(inputs["LOGITS"])
        labels = logits.argmax(axis=1).astype(np.int64).reshape(-1, 1)
        return {"LABEL": labels, "SCORES": softmax(logits)}

"""`refcnn_postprocess`: logits [N, 10] → the top-1 class and its softmax probability."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline.stage import InvalidInput, ItemError, Stage, TensorSpec

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


def top1(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise (argmax, softmax probability of the argmax) of float [N, C] logits: int64 [N], float32 [N].

    The top class's probability is exp(0) / Σ exp(x - max) = 1 / Σ exp(x - max), so the full softmax is
    never normalised; subtracting the maximum keeps `exp` from overflowing.
    """
    labels = logits.argmax(axis=1)
    top = np.take_along_axis(logits, labels[:, None], axis=1).astype(np.float32)
    shifted = logits.astype(np.float32)  # a copy: the input is a read-only view of the request bytes
    # A logit so far below the maximum that the difference overflows to -inf contributes exp(-inf) = 0.
    with np.errstate(over="ignore"):
        shifted -= top
    np.exp(shifted, out=shifted)
    prob = np.reciprocal(shifted.sum(axis=1, dtype=np.float32))
    return labels.astype(np.int64, copy=False), prob


class RefCNNPostprocess(Stage):
    """`LOGITS` FP32 [N, 10] → `LABEL` INT64 [N, 1] (top-1 class) and `PROB` FP32 [N, 1] (its probability)."""

    inline = True  # a few microseconds of numpy per call

    inputs = (TensorSpec("LOGITS", "FP32", (-1, NUM_CLASSES)),)
    outputs = (TensorSpec("LABEL", "INT64", (-1, 1)), TensorSpec("PROB", "FP32", (-1, 1)))
    max_batch_size = 256

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Classify a batch; a row with NaN or infinite logits is refused, naming its index."""
        labels, prob = top1(check_finite(inputs["LOGITS"]))
        return {"LABEL": labels.reshape(-1, 1), "PROB": prob.reshape(-1, 1)}

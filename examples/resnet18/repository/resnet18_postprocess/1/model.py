"""`resnet18_postprocess`: logits → the most likely class and its probability (softmax)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline.stage import Stage, TensorSpec


class TopClass(Stage):
    """`LOGITS` FP32 [N, 1000] → `CLASS` INT64 [N, 1] and `SCORE` FP32 [N, 1]."""

    max_batch_size = 32
    inputs = (TensorSpec("LOGITS", "FP32", (-1, 1000)),)
    outputs = (TensorSpec("CLASS", "INT64", (-1, 1)), TensorSpec("SCORE", "FP32", (-1, 1)))
    inline = True  # microseconds of numpy

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        logits = inputs["LOGITS"]
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities = shifted / shifted.sum(axis=1, keepdims=True)
        best = probabilities.argmax(axis=1)
        score = probabilities[np.arange(len(best)), best]
        return {"CLASS": best.astype(np.int64)[:, None], "SCORE": score.astype(np.float32)[:, None]}

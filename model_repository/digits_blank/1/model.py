"""`digits_blank`: the fixed answer of the `digits_gated` ensemble for an image with no digit on it.

`LABEL` is -1 (no digit) and every class's score is 0, in the shapes the digits ensemble answers with, so a
client reads both branches' answers the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline.stage import Stage, TensorSpec

#: The digits: 0 to 9.
NUM_CLASSES = 10
#: The label of an image that holds no digit.
NO_DIGIT = -1


class DigitsBlank(Stage):
    """`INK` [N, 1] → `LABEL` [N, 1] = -1 and `SCORES` [N, 10] = 0, whatever the ink."""

    inline = True  # two constant arrays

    max_batch_size = 256
    inputs = (TensorSpec("INK", "FP32", (-1, 1)),)
    outputs = (
        TensorSpec("LABEL", "INT64", (-1, 1)),
        TensorSpec("SCORES", "FP32", (-1, NUM_CLASSES)),
    )

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        count = inputs["INK"].shape[0]
        return {
            "LABEL": np.full((count, 1), NO_DIGIT, dtype=np.int64),
            "SCORES": np.zeros((count, NUM_CLASSES), dtype=np.float32),
        }

"""`digits_ink`: how much ink a preprocessed digit image holds, the cheap check of the `digits_gated` ensemble.

`PIXELS` are ink counts from 0 (paper) to 16 (full ink) per 8×8 block; `INK` is their mean over the image as
a share of full ink, from 0.0 (a blank page) to 1.0. The preprocess stage maps an image whose paper and ink
are too close to tell apart to all paper, so a blank image gives exactly 0.0, and a handwritten digit
about 0.2 to 0.4.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline.stage import Stage, TensorSpec

#: The value of full ink in `PIXELS`.
FULL_INK = 16.0


class DigitsInk(Stage):
    """`PIXELS` [N, 1, 8, 8] → `INK` [N, 1]: the share of full ink in each image."""

    inline = True  # one mean over 64 numbers per image

    max_batch_size = 256
    inputs = (TensorSpec("PIXELS", "FP32", (-1, 1, 8, 8)),)
    outputs = (TensorSpec("INK", "FP32", (-1, 1)),)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        pixels = inputs["PIXELS"]
        ink = pixels.reshape(pixels.shape[0], -1).mean(axis=1, keepdims=True) / FULL_INK
        return {"INK": ink.astype(np.float32)}

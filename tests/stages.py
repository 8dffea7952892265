"""Small stage models the integration tests serve."""

from __future__ import annotations

import numpy as np

from pipeline.errors import InvalidInput
from pipeline.stage import Stage, TensorSpec


class Scale(Stage):
    """Y = 2X on rows of 3; refuses rows with a negative value, naming the row of the batch it saw."""

    name = "scale"
    inputs = (TensorSpec("X", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def __init__(self, name: str = "scale", max_batch_size: int = 32) -> None:
        self.name = name
        self.max_batch_size = max_batch_size

    def infer(self, inputs):
        x = inputs["X"]
        bad = np.flatnonzero((x < 0).any(axis=1))
        if bad.size:
            raise InvalidInput(f"X[{bad[0]}]: negative values are not allowed")
        return {"Y": x * 2}

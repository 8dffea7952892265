"""`pagenumber_join`: the digits CNN's logits for each crop of a page, in order → the page's number.

In: `LOGITS` [n, 10] (n = 0 for a page without digits). Out: `NUMBER` [1], the digits as text ("" for none),
and `DIGITS` [n] INT64, each crop's digit.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline.stage import InvalidInput, Stage, TensorSpec


class PageJoin(Stage):
    """`LOGITS` [n, 10] → `NUMBER` [1] (text) and `DIGITS` [n]."""

    inline = True  # an argmax over a few rows
    inputs = (TensorSpec("LOGITS", "FP32", (-1, 10)),)
    outputs = (TensorSpec("NUMBER", "BYTES", (1,)), TensorSpec("DIGITS", "INT64", (-1,)))
    max_batch_size = 0

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        logits = inputs["LOGITS"]
        if not np.isfinite(logits).all():
            raise InvalidInput("LOGITS: every logit must be finite")
        digits = logits.argmax(axis=1).astype(np.int64)
        number = np.empty(1, dtype=object)
        number[0] = "".join(str(int(d)) for d in digits).encode()
        return {"NUMBER": number, "DIGITS": digits}

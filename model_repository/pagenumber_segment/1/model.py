"""`pagenumber_segment`: a page of handwritten digits side by side → one 8×8 crop per digit, left to right.

The page is drawn as `examples.pagenumber` draws it: each digit 8×8 ink counts (0..16, like scikit-learn's
digits) at `cell` pixels per count, dark ink on light paper, digits apart by at least one blank cell. The
stage decodes the page, turns it grey, takes the paper's level from the border, maps it to 0 and black to
16, and averages each `cell`×`cell` block (the box filter that made scikit-learn's 8×8 counts from 32×32
bitmaps). On that map of ink counts a digit is a run of columns with ink (any count of at least one half)
between blank columns; its rows with ink are cut out and centred in an 8×8 crop, as the digits are centred
in their own 8×8 images (a digit wider or taller than 8 keeps its middle 8).

Out: `CROPS` [n, 1, 8, 8] FP32, n the number of digits found (0 on a blank page), in the units the digits CNN
reads. Parameters (config.pbtxt): `cell` (pixels per ink count, default 4) and `max_image_pixels` (the
largest width × height accepted, checked from the header before any pixel is decoded).
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np
from PIL import Image

from pipeline.stage import InvalidInput, Stage, TensorSpec

#: Side of a crop, as in scikit-learn's digits.
SIZE = 8
#: Full ink.
INK = 16.0
#: A cell holds ink from half a count up (the page's grey levels are rounded to 8 bits).
THRESHOLD = 0.5


def ink_map(grey: np.ndarray, cell: int) -> np.ndarray:
    """The page's ink counts per `cell`×`cell` block: paper (the border's median level) 0, black 16."""
    border = np.concatenate([grey[0], grey[-1], grey[:, 0], grey[:, -1]])
    paper = float(np.median(border))
    ink = np.clip((paper - grey) * (INK / max(paper, 1.0)), 0.0, INK)
    rows, columns = grey.shape[0] // cell, grey.shape[1] // cell
    blocks = ink[: rows * cell, : columns * cell].reshape(rows, cell, columns, cell)
    return blocks.mean(axis=(1, 3), dtype=np.float32)


def crops(counts: np.ndarray) -> np.ndarray:
    """One centred 8×8 crop per run of inked columns of an ink map, left to right: [n, 1, 8, 8]."""
    inked = np.flatnonzero(counts.max(axis=0) >= THRESHOLD)
    if inked.size == 0:
        return np.zeros((0, 1, SIZE, SIZE), np.float32)
    # A run ends where the next inked column is not the next column.
    breaks = np.flatnonzero(np.diff(inked) > 1)
    starts = np.concatenate([[inked[0]], inked[breaks + 1]])
    ends = np.concatenate([inked[breaks], [inked[-1]]]) + 1
    out = np.zeros((len(starts), 1, SIZE, SIZE), np.float32)
    for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
        digit = counts[:, start:end]
        rows = np.flatnonzero(digit.max(axis=1) >= THRESHOLD)
        digit = digit[rows[0] : rows[-1] + 1]
        out[i, 0] = _centred(digit)
    return out


def _centred(digit: np.ndarray) -> np.ndarray:
    """`digit` in the middle of an 8×8 crop (its middle 8×8 where it is larger)."""
    height, width = digit.shape
    top, left = max((height - SIZE) // 2, 0), max((width - SIZE) // 2, 0)
    digit = digit[top : top + SIZE, left : left + SIZE]
    height, width = digit.shape
    crop = np.zeros((SIZE, SIZE), np.float32)
    row, column = (SIZE - height) // 2, (SIZE - width) // 2
    crop[row : row + height, column : column + width] = digit
    return crop


class PageSegment(Stage):
    """A page (PNG or JPEG) → `CROPS` [n, 1, 8, 8], one per digit (see the module docstring)."""

    inputs = (TensorSpec("PAGE", "BYTES", (1,)),)
    outputs = (TensorSpec("CROPS", "FP32", (-1, 1, SIZE, SIZE)),)
    max_batch_size = 0
    cell = 4
    max_image_pixels = 4_000_000

    def load(self) -> None:
        """Read the `cell` and `max_image_pixels` parameters."""
        self.cell = int(self.parameters.get("cell", self.cell))
        self.max_image_pixels = int(self.parameters.get("max_image_pixels", self.max_image_pixels))
        if self.cell < 1 or self.max_image_pixels < 1:
            raise ValueError(
                f"cell ({self.cell}) and max_image_pixels ({self.max_image_pixels}) must be >= 1"
            )

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        page = inputs["PAGE"].reshape(-1)[0]
        try:
            with Image.open(io.BytesIO(bytes(page))) as image:
                pixels = image.width * image.height
                if pixels > self.max_image_pixels:
                    raise InvalidInput(
                        f"PAGE: {image.width}x{image.height} is {pixels} pixels, more than max_image_pixels "
                        f"{self.max_image_pixels}"
                    )
                grey = np.asarray(image.convert("L"), np.float32)
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise InvalidInput(f"PAGE: not a PNG or JPEG image this stage can decode: {exc}") from None
        if min(grey.shape) < self.cell:
            raise InvalidInput(
                f"PAGE: {grey.shape[1]}x{grey.shape[0]} is smaller than one cell ({self.cell})"
            )
        return {"CROPS": crops(ink_map(grey, self.cell))}

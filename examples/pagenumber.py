"""Pages of handwritten numbers for the `pagenumber` example: scikit-learn's held-out digits side by side.

Each digit is one of the 360 held-out images of `examples.models.digits` (never one the CNN was trained on):
8×8 ink counts (0..16) drawn at `CELL` pixels per count, dark ink on white paper (grey = 255 - ink × 255 / 16),
next to each other with blank gaps of one to three cells and a margin of two, so that the page's pixels sit
on the `CELL`-pixel grid that `pagenumber_segment` reads back. A page is a grey PNG; its number is the
digits' labels in order.

    python -m examples.pagenumber page.png [--digits 6] [--seed 0]    # writes a page, prints its number
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Sequence

import numpy as np
from PIL import Image

#: Pixels per ink count (per cell of the 8×8 digit), as `pagenumber_segment`'s `cell` parameter says.
CELL = 4
#: Full ink, as in scikit-learn's digits.
INK = 16.0
#: Blank cells around the digits.
MARGIN = 2


def draw_page(images: Sequence[np.ndarray], gaps: Sequence[int]) -> bytes:
    """A PNG of `images` (each 8×8 ink counts) left to right, `gaps[i]` blank cells before image i."""
    width = MARGIN + sum(gap + image.shape[-1] for gap, image in zip(gaps, images, strict=True)) + MARGIN
    ink = np.zeros((MARGIN + 8 + MARGIN, max(width, 2 * MARGIN)), np.float32)
    column = MARGIN
    for gap, image in zip(gaps, images, strict=True):
        column += gap
        ink[MARGIN : MARGIN + 8, column : column + 8] = image.reshape(8, 8)
        column += 8
    grey = np.round(255.0 - ink * (255.0 / INK)).astype(np.uint8)
    pixels = np.kron(grey, np.ones((CELL, CELL), np.uint8))
    out = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(out, format="PNG")
    return out.getvalue()


def held_out_pages(count: int, digits: int, seed: int = 0) -> list[tuple[bytes, str]]:
    """`count` pages of `digits` held-out digits each, drawn at random (seeded): (PNG, number)."""
    from examples.models.digits import load_split

    _, _, images, labels = load_split()
    rng = np.random.default_rng(seed)
    pages = []
    for _ in range(count):
        chosen = rng.integers(0, len(images), digits)
        gaps = [0, *rng.integers(1, 4, max(digits - 1, 0)).tolist()][:digits]
        number = "".join(str(int(labels[i])) for i in chosen)
        pages.append((draw_page([images[i] for i in chosen], gaps), number))
    return pages


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m examples.pagenumber", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("output", help="the PNG file to write")
    parser.add_argument("--digits", type=int, default=6, help="digits on the page (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="which digits (default %(default)s)")
    args = parser.parse_args(argv)
    [(page, number)] = held_out_pages(1, args.digits, args.seed)
    with open(args.output, "wb") as out:
        out.write(page)
    print(number)


if __name__ == "__main__":
    main()

"""Images to send the `digits` ensemble: held-out handwritten digits (never seen in training) as the files a
user's scans would be.

    python -m examples.digit_images [FOLDER]    # writes three.png, seven.png and seven.jpg there (default .)
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from examples.models.digits import load_split


def encode(
    image: np.ndarray, *, scale: int = 4, fmt: str = "PNG", mode: str = "L", invert: bool = False
) -> bytes:
    """An 8x8 sklearn digit (0..16, ink high) as an image file a user might send."""
    grey = np.clip(image.reshape(8, 8) * (255 / 16), 0, 255).astype(np.uint8)
    if invert:
        grey = 255 - grey  # dark ink on white paper
    picture = (
        Image.fromarray(grey, "L").resize((8 * scale, 8 * scale), Image.Resampling.NEAREST).convert(mode)
    )
    out = io.BytesIO()
    picture.save(out, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return out.getvalue()


def write(folder: Path) -> list[Path]:
    """The first held-out 3 and 7 as `three.png`, `seven.png` and `seven.jpg` in `folder`."""
    _, _, x_test, y_test = load_split()
    three, seven = (x_test[np.flatnonzero(y_test == digit)[0]] for digit in (3, 7))
    files = {
        "three.png": encode(three, scale=4),
        "seven.png": encode(seven, scale=4),
        "seven.jpg": encode(seven, scale=4, fmt="JPEG"),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return [folder / name for name in files]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m examples.digit_images", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("folder", nargs="?", type=Path, default=Path("."))
    for path in write(parser.parse_args(argv).folder):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

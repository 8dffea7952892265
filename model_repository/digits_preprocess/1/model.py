"""`digits_preprocess`: encoded images of handwritten digits → 8×8 ink maps like scikit-learn's digits.

scikit-learn's digits are 32×32 binary bitmaps reduced to 8×8 by counting the ink pixels in each 4×4 block,
so every value is an ink count from 0 to 16 and ink is the high value. This stage makes any PNG or JPEG look
like that: it decodes the image, turns it grey, finds which side of the grey scale is paper (from the border),
maps the paper to 0 and the darkest ink (or brightest, on dark paper) to 16, and reduces the picture to 8×8
with a box (area) filter, which is what counting ink per block is.

Contrast mapping is affine and the box filter is linear, so they commute: each image is reduced to 8×8 in its
own grey levels while decoding, and the mapping runs afterwards on the whole batch at once.

A second output, `INK`, is each image's share of full ink (the mean of its 8×8 map over 16: 0.0 for a blank
page, about 0.2 to 0.4 for a handwritten digit): the cheap check on which the `digits_gated` ensemble
decides whether an image goes on to the CNN. It costs one mean per image, here where the map already is,
instead of a stage call of its own.

Parameters (config.pbtxt), both checked from the images' headers before any pixel is decoded:

- `max_image_pixels`: the largest width × height accepted per image (decompression bombs);
- `max_batch_pixels`: the pixels a batch may hold in all. Taken in order, an image that would take the batch
  past it is refused (INVALID_ARGUMENT naming the limit) while the rest go on, so that many large images,
  each under the per-image cap, cannot buy seconds of CPU with one request: 64 PNGs of 4000×4000 cost about
  26 s to decode here, the default budget about 2 s.

Decoding stops between images once the call's deadline has passed or its client has gone (`Stage.expired`):
the batch is then answered DEADLINE_EXCEEDED, and the instance is free for the next.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from PIL import Image

from pipeline.stage import DeadlineExceeded, InvalidInput, ItemError, Stage, TensorSpec

log = logging.getLogger(__name__)

#: Side of the output images, as in scikit-learn's digits.
SIZE = 8
#: Value of full ink in the output (a 4×4 block of the original 32×32 bitmap, all ink).
INK = 16.0
#: Default cap on decoded pixels per image: far above any digit photo, far below a decompression bomb.
DEFAULT_MAX_IMAGE_PIXELS = 16_000_000
#: Default pixel budget of a batch: four images at the per-image cap, or a batch of 256 phone-sized photos.
DEFAULT_MAX_BATCH_PIXELS = 64_000_000

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"
# JPEG can decode at 1/2, 1/4 or 1/8 scale in the DCT (an area average, much cheaper than full decoding);
# ask for no less than this so the paper and ink levels are still measured on real strokes.
_JPEG_DRAFT_SIZE = (64, 64)
# Below this grey-level distance between paper and ink (on a 0..255 scale) the image is blank.
_MIN_CONTRAST = 8.0 / 255.0
_HIGH_DEPTH_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N", "F"})
# How many refused images an error message cites (its details name every one).
_MESSAGE_ITEMS = 8
# What each image past the batch's pixel budget is refused with: short, as there may be hundreds.
_OVER_BUDGET = "over the batch's pixel budget"


class DigitsPreprocess(Stage):
    """Decodes a batch of PNG/JPEG digit images into `PIXELS` [N, 1, 8, 8], ink counts 0..16 as float32, and
    `INK` [N, 1], each image's share of full ink."""

    inputs = (TensorSpec("IMAGE", "BYTES", (-1, 1)),)
    outputs = (TensorSpec("PIXELS", "FP32", (-1, 1, SIZE, SIZE)), TensorSpec("INK", "FP32", (-1, 1)))
    max_batch_size = 256
    max_image_pixels = DEFAULT_MAX_IMAGE_PIXELS
    max_batch_pixels = DEFAULT_MAX_BATCH_PIXELS

    def load(self) -> None:
        """Read the `max_image_pixels` and `max_batch_pixels` parameters."""
        self.max_image_pixels = self._pixels_parameter("max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS)
        self.max_batch_pixels = self._pixels_parameter("max_batch_pixels", DEFAULT_MAX_BATCH_PIXELS)
        if self.max_batch_pixels < self.max_image_pixels:
            raise ValueError(
                f"parameter max_batch_pixels ({self.max_batch_pixels}) is below max_image_pixels "
                f"({self.max_image_pixels}): an image the per-image cap allows would be refused on its own"
            )

    def _pixels_parameter(self, key: str, default: int) -> int:
        value = self.parameters.get(key, str(default))
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"parameter {key} must be an integer >= 1, got {value!r}")
        return int(value)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Decode every image of the batch; images that cannot be used fail it, each named."""
        images = inputs["IMAGE"]
        pixels = images_to_pixels(
            images.reshape(-1),
            max_image_pixels=self.max_image_pixels,
            max_batch_pixels=self.max_batch_pixels,
            expired=self.expired,
            name="IMAGE",
        )
        ink = pixels.reshape(images.shape[0], -1).mean(axis=1, keepdims=True) / INK
        return {"PIXELS": pixels.reshape(images.shape[0], 1, SIZE, SIZE), "INK": ink.astype(np.float32)}


def images_to_pixels(
    images: Sequence[object] | np.ndarray,
    *,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_batch_pixels: int = DEFAULT_MAX_BATCH_PIXELS,
    expired: Callable[[], bool] | None = None,
    name: str = "IMAGE",
) -> np.ndarray:
    """Encoded images → float32 [N, 8, 8] ink maps, 0 for paper and 16 for full ink.

    Every header is read first: images that are not PNG or JPEG, over `max_image_pixels`, or past the batch's
    `max_batch_pixels` are all refused together, before any pixel is decoded. `expired` is asked between
    images while decoding; once it answers True the batch stops with `DeadlineExceeded`. `name` is the
    tensor name that error messages cite, with the index of the offending image.
    """
    count = len(images)
    reduced = np.empty((count, SIZE, SIZE), dtype=np.float32)
    paper = np.empty(count, dtype=np.float32)
    ink = np.empty(count, dtype=np.float32)
    with contextlib.ExitStack() as opened:
        headers = _open_all(images, max_image_pixels, max_batch_pixels, name, opened)
        bad = []
        for i, image in enumerate(headers):
            if expired is not None and expired():
                raise DeadlineExceeded(f"deadline exceeded after decoding {i} of {count} images: stopped")
            try:
                reduced[i], paper[i], ink[i] = _decode_one(image, f"{name}[{i}]")
            except InvalidInput as err:  # every bad image is reported, so one answer names them all
                bad.append(ItemError(name, i, err.message.removeprefix(f"{name}[{i}]: ")))
    if bad:
        raise refused(bad)

    # Paper → 0, ink → 1; the sign of `span` carries the polarity, so light ink on dark paper and dark ink
    # on light paper take the same path.
    span = ink - paper
    blank = np.abs(span) < _MIN_CONTRAST
    span[blank] = 1.0
    out = reduced
    out -= paper[:, None, None]
    out /= span[:, None, None]
    np.clip(out, 0.0, 1.0, out=out)
    out *= INK
    out[blank] = 0.0
    return out


def _open_all(
    images: Sequence[object] | np.ndarray,
    max_image_pixels: int,
    max_batch_pixels: int,
    name: str,
    opened: contextlib.ExitStack,
) -> list[Image.Image]:
    """Every image opened (its header read, no pixel decoded) and closed with `opened`; `InvalidInput` naming
    each image that cannot be used, or that would take the batch past `max_batch_pixels`."""
    headers = []
    bad = []
    left = max_batch_pixels
    for i, data in enumerate(images):
        try:
            image = opened.enter_context(_open_one(data, max_image_pixels, f"{name}[{i}]"))
        except InvalidInput as err:
            bad.append(ItemError(name, i, err.message.removeprefix(f"{name}[{i}]: ")))
            continue
        width, height = image.size
        if width * height > left:
            bad.append(ItemError(name, i, _OVER_BUDGET))
            continue
        left -= width * height
        headers.append(image)
    if bad:
        over = any(item.description == _OVER_BUDGET for item in bad)
        raise refused(
            bad, f" (max_batch_pixels: a batch's images hold {max_batch_pixels} pixels at most)" * over
        )
    return headers


def refused(bad: Sequence[ItemError], note: str = "") -> InvalidInput:
    """One error for the refused images: its details name each (the router drops those and sends the rest
    again), its message the first few and then `note`, so that a batch of hundreds of refusals still fits
    in a gRPC trailer."""
    shown = "; ".join(f"{item.field}: {item.description}" for item in bad[:_MESSAGE_ITEMS])
    more = f"; and {len(bad) - _MESSAGE_ITEMS} more image(s)" if len(bad) > _MESSAGE_ITEMS else ""
    return InvalidInput(shown + more + note, items=bad)


def _open_one(data: object, max_pixels: int, where: str) -> Image.Image:
    """One image, opened from its header, or `InvalidInput` naming `where`."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidInput(f"{where}: expected encoded image bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise InvalidInput(f"{where}: cannot decode image: empty")
    head = bytes(data[:8])
    if not (head.startswith(_PNG_MAGIC) or head.startswith(_JPEG_MAGIC)):
        raise InvalidInput(f"{where}: cannot decode image: not a PNG or JPEG (only those are accepted)")
    try:
        # BytesIO shares an immutable `bytes` object rather than copying it.
        image = Image.open(io.BytesIO(data), formats=("PNG", "JPEG"))
    except Image.DecompressionBombError as exc:
        raise InvalidInput(f"{where}: image too large: {exc}") from None
    except Exception as exc:  # Pillow reports malformed headers with many exception types
        raise InvalidInput(f"{where}: cannot decode image: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise InvalidInput(
            f"{where}: image too large: {width}×{height} = {width * height} pixels, the limit is {max_pixels}"
        )
    if width < 1 or height < 1:
        image.close()
        raise InvalidInput(f"{where}: cannot decode image: empty ({width}×{height})")
    return image


def _decode_one(image: Image.Image, where: str) -> tuple[np.ndarray, float, float]:
    """One opened image → (8×8 grey levels in 0..1, paper level, ink level), or `InvalidInput` naming
    `where`."""
    try:
        grey = _grey(image)
        return _measure_and_reduce(grey)
    except Exception as exc:  # truncated or corrupt pixel data surfaces only while decoding
        raise InvalidInput(f"{where}: cannot decode image: {exc}") from None


def _grey(image: Image.Image) -> Image.Image:
    """Decode into one grey channel: mode "L", or "F" for 16-bit images (their depth is kept)."""
    if image.format == "JPEG":
        image.draft("L", _JPEG_DRAFT_SIZE)
    if image.mode in _HIGH_DEPTH_MODES:
        return image.convert("F")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        return _flatten_alpha(image.convert("LA"))
    return image if image.mode == "L" else image.convert("L")


def _flatten_alpha(image: Image.Image) -> Image.Image:
    """Put a partly transparent drawing on paper that contrasts with its ink.

    What lies under transparent pixels is arbitrary (often black), so the colour channels alone can hide the
    digit. The opaque part is taken to be the ink: it goes on white paper when it is dark, on black when light.
    """
    grey, alpha = image.split()
    if alpha.getextrema()[0] == 255:
        return grey
    g = np.asarray(grey, dtype=np.float32)
    a = np.asarray(alpha, dtype=np.float32) / 255.0
    weight = float(a.sum())
    ink_level = float((g * a).sum()) / weight if weight > 0 else 0.0
    paper = 255.0 if ink_level < 128.0 else 0.0
    flat = g * a + paper * (1.0 - a)
    return Image.fromarray(np.rint(flat).astype(np.uint8), mode="L")


def _measure_and_reduce(grey: Image.Image) -> tuple[np.ndarray, float, float]:
    """Paper level (median of a border ring), ink level (the grey extreme away from the paper), 8×8 box mean.

    Levels are scaled to 0..1 for "L" images; "F" images keep their own scale, which only the ratio sees.
    """
    width, height = grey.size
    ring = max(1, min(width, height) // 16)
    border = np.concatenate(
        [
            np.asarray(grey.crop((0, 0, width, ring))).ravel(),
            np.asarray(grey.crop((0, height - ring, width, height))).ravel(),
            np.asarray(grey.crop((0, ring, ring, height - ring))).ravel(),
            np.asarray(grey.crop((width - ring, ring, width, height - ring))).ravel(),
        ]
    )
    paper = float(np.median(border))
    extrema = grey.getextrema()  # one (low, high) pair: the image has one band
    low, high = float(extrema[0]), float(extrema[1])  # type: ignore[arg-type]
    # Paper nearer the dark end means light ink, and the reverse.
    ink = high if paper - low <= high - paper else low
    small = np.asarray(grey.resize((SIZE, SIZE), Image.Resampling.BOX), dtype=np.float32)
    scale = 255.0 if grey.mode == "L" else max(abs(high), abs(low), 1.0)
    return small / scale, paper / scale, ink / scale

"""`digits_preprocess`: real scikit-learn digits, encoded every way a client might, must come back as themselves."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from examples.models.digits import load_split
from pipeline.protocol.errors import DeadlineExceeded, InvalidInput, RepositoryError
from pipeline.stage.api import Stage
from tests.stages import example_module, example_stage

images_to_pixels = example_module("digits_preprocess").images_to_pixels


def digits_preprocess(**parameters: object) -> Stage:
    """The example repository's `digits_preprocess`, loaded through the python backend."""
    return example_stage("digits_preprocess", **parameters)


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    """Four held-out digits of every class, [40, 8, 8] ink counts 0..16."""
    _, _, x_test, y_test = load_split()
    picks = np.concatenate([np.flatnonzero(y_test == label)[:4] for label in range(10)])
    return x_test[picks, 0]


def to_grey(digit: np.ndarray, *, dark_ink: bool) -> np.ndarray:
    """Ink counts → 8-bit grey, light ink on black or dark ink on white."""
    grey = np.rint(digit * (255.0 / 16.0)).astype(np.uint8)
    return 255 - grey if dark_ink else grey


def encode(grey: np.ndarray, *, fmt: str = "PNG", mode: str = "L", size: int = 8) -> bytes:
    """Upscale with nearest neighbour (each ink count becomes a block) and encode."""
    image = Image.fromarray(grey, "L")
    if size != grey.shape[0]:
        image = image.resize((size, size), Image.Resampling.NEAREST)
    buffer = io.BytesIO()
    image.convert(mode).save(buffer, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def batch(*images: bytes) -> dict[str, np.ndarray]:
    """A BYTES [N, 1] input as the runtime hands it over."""
    array = np.empty((len(images), 1), dtype=object)
    for i, image in enumerate(images):
        array[i, 0] = image
    return {"IMAGE": array}


def stretched(digits: np.ndarray) -> np.ndarray:
    """The documented contrast mapping: each image's strongest ink becomes 16."""
    return digits * (16.0 / digits.reshape(len(digits), -1).max(axis=1))[:, None, None]


CASES = [
    (fmt, mode, size, dark_ink)
    for fmt in ("PNG", "JPEG")
    for mode in ("L", "RGB", "RGBA")
    for size in (8, 32, 100, 512)
    for dark_ink in (False, True)
    if not (fmt == "JPEG" and mode == "RGBA")  # JPEG has no alpha channel
]


@pytest.mark.parametrize(("fmt", "mode", "size", "dark_ink"), CASES)
def test_encoded_digits_decode_to_the_originals(
    digits: np.ndarray, fmt: str, mode: str, size: int, dark_ink: bool
) -> None:
    stage = digits_preprocess()
    images = [encode(to_grey(d, dark_ink=dark_ink), fmt=fmt, mode=mode, size=size) for d in digits]
    pixels = stage.infer(batch(*images))["PIXELS"]

    assert pixels.shape == (len(digits), 1, 8, 8)
    assert pixels.dtype == np.float32
    assert pixels.min() >= 0.0 and pixels.max() <= 16.0
    error = np.abs(pixels[:, 0] - digits)
    # Box-filtering a whole-number upscale of a PNG gives back the 8×8 exactly, up to the contrast stretch
    # of the few digits whose strongest ink is 15 (1 unit); 100 px is not a multiple of 8 and JPEG is lossy.
    exact = fmt == "PNG" and size % 8 == 0
    assert error.mean() < (0.05 if exact else 0.35)
    assert error.max() <= (1.01 if exact else 4.0)
    if exact:
        np.testing.assert_allclose(pixels[:, 0], stretched(digits), atol=0.05)


def test_both_polarities_give_the_same_pixels(digits: np.ndarray) -> None:
    stage = digits_preprocess()
    light = stage.infer(batch(*(encode(to_grey(d, dark_ink=False), size=40) for d in digits)))["PIXELS"]
    dark = stage.infer(batch(*(encode(to_grey(d, dark_ink=True), size=40) for d in digits)))["PIXELS"]
    np.testing.assert_allclose(light, dark, atol=0.1)


def test_faint_ink_on_grey_paper_is_stretched_to_full_range(digits: np.ndarray) -> None:
    # Pencil on recycled paper: ink at grey 90, paper at 170. Same digit as black on white.
    grey = (170 - np.rint(digits[0] * (80 / 16))).astype(np.uint8)
    pixels = images_to_pixels([encode(grey, size=32)])
    np.testing.assert_allclose(pixels[0], stretched(digits[:1])[0], atol=0.3)


def test_transparent_background_is_flattened(digits: np.ndarray) -> None:
    # Ink drawn opaque on a fully transparent canvas; the colour under transparent pixels is black (the
    # common default), which hides black ink unless alpha is honoured.
    alpha = to_grey(digits[0], dark_ink=False)
    for ink in (0, 255):
        rgba = np.zeros((8, 8, 4), dtype=np.uint8)
        rgba[..., :3] = ink
        rgba[..., 3] = alpha
        buffer = io.BytesIO()
        Image.fromarray(rgba, "RGBA").resize((32, 32), Image.Resampling.NEAREST).save(buffer, "PNG")
        pixels = images_to_pixels([buffer.getvalue()])
        np.testing.assert_allclose(pixels[0], stretched(digits[:1])[0], atol=0.1)


def test_palette_and_16_bit_pngs(digits: np.ndarray) -> None:
    grey = to_grey(digits[1], dark_ink=True)
    palette, deep = io.BytesIO(), io.BytesIO()
    Image.fromarray(grey, "L").convert("P").save(palette, "PNG")
    Image.fromarray(grey.astype(np.uint16) * 257).save(deep, "PNG")
    assert Image.open(io.BytesIO(deep.getvalue())).mode.startswith("I;16")
    pixels = images_to_pixels([palette.getvalue(), deep.getvalue()])
    np.testing.assert_allclose(pixels, stretched(digits[[1, 1]]), atol=0.1)


def test_blank_image_is_all_paper() -> None:
    pixels = images_to_pixels([encode(np.full((8, 8), 200, np.uint8), size=64)])
    assert not pixels.any()


def test_batch_keeps_order(digits: np.ndarray) -> None:
    images = [encode(to_grey(d, dark_ink=i % 2 == 0), size=8 * (1 + i % 5)) for i, d in enumerate(digits)]
    together = images_to_pixels(images)
    one_by_one = np.stack([images_to_pixels([image])[0] for image in images])
    np.testing.assert_array_equal(together, one_by_one)


def _other_format(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (8, 8), 255).save(buffer, fmt)
    return buffer.getvalue()


def _truncated_png() -> bytes:
    noise = np.random.default_rng(0).integers(0, 256, (64, 64), dtype=np.uint8)
    data = encode(noise)
    return data[: len(data) // 2]


BAD = {
    "empty": (b"", "empty"),
    "corrupt": (b"\x00\x01 definitely not an image \xff" * 4, "not a PNG or JPEG"),
    "gif": (_other_format("GIF"), "not a PNG or JPEG"),
    "bmp": (_other_format("BMP"), "not a PNG or JPEG"),
    "png-magic-then-garbage": (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "cannot decode image"),
    "jpeg-magic-then-garbage": (b"\xff\xd8\xff" + b"\x13" * 40, "cannot decode image"),
    "truncated-png": (_truncated_png(), "cannot decode image"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("index", [0, 3])
def test_undecodable_image_is_refused_naming_its_index(digits: np.ndarray, kind: str, index: int) -> None:
    data, reason = BAD[kind]
    images = [encode(to_grey(d, dark_ink=False)) for d in digits[:5]]
    images[index] = data
    with pytest.raises(InvalidInput, match=rf"^IMAGE\[{index}\]: ") as caught:
        digits_preprocess().infer(batch(*images))
    assert reason in caught.value.message


def test_every_bad_image_of_a_batch_is_named(digits: np.ndarray) -> None:
    images = [encode(to_grey(d, dark_ink=False)) for d in digits[:5]]
    images[1], images[4] = b"not an image", b""
    with pytest.raises(InvalidInput) as caught:
        digits_preprocess().infer(batch(*images))
    assert [(item.tensor, item.index) for item in caught.value.items] == [("IMAGE", 1), ("IMAGE", 4)]
    assert caught.value.items[1].description == "cannot decode image: empty"


def test_non_bytes_element_is_refused() -> None:
    with pytest.raises(InvalidInput, match=r"^IMAGE\[0\]: expected encoded image bytes"):
        images_to_pixels(["a string"])


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims a huge size in a few dozen bytes: what a decompression bomb looks like up front."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def test_decompression_bomb_over_the_cap_is_refused_before_decoding() -> None:
    # 25 megapixels is over the 16-megapixel default; the pixel data is missing, so only a check made from
    # the header (before decoding) can report "too large" rather than "cannot decode".
    with pytest.raises(InvalidInput, match=r"^IMAGE\[1\]: image too large: 5000×5000 = 25000000 pixels"):
        digits_preprocess().infer(batch(encode(np.zeros((8, 8), np.uint8)), _png_header_only(5000, 5000)))
    with pytest.raises(InvalidInput, match=r"^IMAGE\[0\]: image too large"):
        images_to_pixels([_png_header_only(100_000, 100_000)])


def test_pixel_cap_is_configurable(digits: np.ndarray) -> None:
    image = encode(to_grey(digits[0], dark_ink=False), size=64)
    digits_preprocess(max_image_pixels=64 * 64).infer(batch(image))
    with pytest.raises(InvalidInput, match=r"^IMAGE\[0\]: image too large: 64×64 = 4096 pixels"):
        digits_preprocess(max_image_pixels=64 * 64 - 1).infer(batch(image))
    with pytest.raises(
        RepositoryError, match=r"model\.py: .*parameter max_image_pixels must be an integer >= 1"
    ):
        digits_preprocess(max_image_pixels=0)


def test_a_batch_over_its_pixel_budget_is_refused_from_the_headers(digits: np.ndarray) -> None:
    # Header-only PNGs cannot be decoded: a refusal that names the budget, not "cannot decode", shows that the
    # budget was checked before any pixel was.
    stage = digits_preprocess(max_image_pixels=2_000_000, max_batch_pixels=2_500_000)
    big, small = _png_header_only(2000, 1000), encode(to_grey(digits[0], dark_ink=False))
    with pytest.raises(InvalidInput) as caught:
        stage.infer(batch(big, big, small, _png_header_only(1000, 1000)))
    assert [item.index for item in caught.value.items] == [1, 3]
    assert caught.value.items[0].description == "over the batch's pixel budget"
    assert caught.value.message == (
        "IMAGE[1]: over the batch's pixel budget; IMAGE[3]: over the batch's pixel budget "
        "(max_batch_pixels: a batch's images hold 2500000 pixels at most)"
    )
    # Within the budget, the same images go through (the router sends a batch again without its refused items).
    small_ones = [encode(to_grey(d, dark_ink=False), size=1000) for d in digits[:2]]
    assert stage.infer(batch(*small_ones))["PIXELS"].shape == (2, 1, 8, 8)
    with pytest.raises(InvalidInput, match=r"^IMAGE\[2\]: over the batch's pixel budget"):
        stage.infer(batch(*small_ones, small_ones[0]))


def test_hundreds_of_refusals_are_named_in_the_details_and_a_few_in_the_message() -> None:
    header = _png_header_only(1000, 1000)
    with pytest.raises(InvalidInput) as caught:
        digits_preprocess(max_image_pixels=1_000_000, max_batch_pixels=1_000_000).infer(
            batch(*[header] * 200)
        )
    assert [item.index for item in caught.value.items] == list(range(1, 200))
    assert (
        caught.value.message.count("IMAGE[") == 8
        and "; and 191 more image(s) (max_batch_pixels" in caught.value.message
    )


def test_the_pixel_budget_is_checked_against_the_per_image_cap() -> None:
    with pytest.raises(RepositoryError, match=r"max_batch_pixels \(100\) is below max_image_pixels \(200\)"):
        digits_preprocess(max_image_pixels=200, max_batch_pixels=100)
    with pytest.raises(RepositoryError, match=r"parameter max_batch_pixels must be an integer >= 1"):
        digits_preprocess(max_batch_pixels="lots")


def test_decoding_stops_between_images_once_the_call_has_expired(digits: np.ndarray) -> None:
    images = [encode(to_grey(d, dark_ink=False)) for d in digits[:5]]
    asked = []

    def expired() -> bool:
        asked.append(True)
        return len(asked) > 2  # two images decoded, then the client is gone

    with pytest.raises(DeadlineExceeded, match="after decoding 2 of 5 images"):
        images_to_pixels(images, expired=expired)
    assert len(asked) == 3
    assert images_to_pixels(images, expired=lambda: False).shape == (5, 8, 8)


def test_declaration() -> None:
    stage = digits_preprocess()
    assert stage.name == "digits_preprocess"
    assert stage.max_batch_size == 256
    assert [(t.name, t.datatype, t.shape) for t in stage.inputs] == [("IMAGE", "BYTES", (-1, 1))]
    assert [(t.name, t.datatype, t.shape) for t in stage.outputs] == [
        ("PIXELS", "FP32", (-1, 1, 8, 8)),
        ("INK", "FP32", (-1, 1)),
    ]

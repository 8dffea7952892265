"""`resnet18_preprocess`: encoded images (PNG, JPEG, ...) → the 224×224 tensors an ImageNet classifier takes.

Each image is decoded, made RGB, resized so that its shorter side is 256 and centre-cropped to 224×224 (the
usual ImageNet evaluation transform), scaled to 0..1 and normalised with ImageNet's per-channel mean and std.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np
from PIL import Image

from pipeline.stage import InvalidInput, Stage, TensorSpec

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1)
#: Images larger than this (width × height) are refused before they are decoded.
MAX_PIXELS = 40_000_000


class ResNetPreprocess(Stage):
    """`IMAGE` BYTES [N, 1] → `PIXELS` FP32 [N, 3, 224, 224]."""

    max_batch_size = 32
    inputs = (TensorSpec("IMAGE", "BYTES", (-1, 1)),)
    outputs = (TensorSpec("PIXELS", "FP32", (-1, 3, 224, 224)),)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        images = inputs["IMAGE"].reshape(-1)
        out = np.empty((len(images), 3, 224, 224), dtype=np.float32)
        for index, data in enumerate(images):
            try:
                image = Image.open(io.BytesIO(data))
                if image.width * image.height > MAX_PIXELS:
                    raise InvalidInput(
                        f"IMAGE[{index}]: {image.width}×{image.height} pixels is over {MAX_PIXELS}"
                    )
                image = image.convert("RGB")
            except (OSError, ValueError) as exc:
                raise InvalidInput(f"IMAGE[{index}]: cannot decode image: {exc}") from None
            scale = 256 / min(image.size)
            image = image.resize(
                (max(224, round(image.width * scale)), max(224, round(image.height * scale)))
            )
            left, top = (image.width - 224) // 2, (image.height - 224) // 2
            crop = np.asarray(image.crop((left, top, left + 224, top + 224)), dtype=np.float32) / 255.0
            out[index] = (crop.transpose(2, 0, 1) - MEAN) / STD
        return {"PIXELS": out}

"""`refcnn_preprocess`: UINT8 images [N, 3, 64, 64] → float32 pixels scaled to 0..1 and normalised per channel.

The throughput workload that peers (TorchServe, MLServer, Ray Serve) serve too; its constants are the peers'
reference model's, so every server computes the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline.stage import Stage, TensorSpec

#: Image side and channels of the workload.
SIZE = 64
CHANNELS = 3
#: Per-channel mean and standard deviation of the reference model (ImageNet's), applied after scaling to 0..1.
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(1, CHANNELS, 1, 1)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(1, CHANNELS, 1, 1)


def normalise(images: np.ndarray) -> np.ndarray:
    """UINT8 [N, 3, H, W] → float32 `(x / 255 - MEAN) / STD`, one new array, the input untouched.

    The three steps stay separate float32 operations, in the reference's order, so the result is bit for bit
    the reference's; folding them into one multiply-add would be cheaper but round differently.
    """
    out = images.astype(np.float32)  # the only allocation; the rest runs in place
    out /= np.float32(255.0)
    out -= MEAN
    out /= STD
    return out


class RefCNNPreprocess(Stage):
    """`IMAGE` UINT8 [N, 3, 64, 64] → `PIXELS` FP32 [N, 3, 64, 64], normalised as the reference model does."""

    inline = True  # a few microseconds of numpy per call

    inputs = (TensorSpec("IMAGE", "UINT8", (-1, CHANNELS, SIZE, SIZE)),)
    outputs = (TensorSpec("PIXELS", "FP32", (-1, CHANNELS, SIZE, SIZE)),)
    max_batch_size = 256

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Normalise a batch."""
        return {"PIXELS": normalise(inputs["IMAGE"])}

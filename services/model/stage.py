"""`digits_cnn`: the digits network served as a stage model on a selectable backend."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import numpy as np

from pipeline.stage import Stage, TensorSpec
from services.model.backends import ModelBackend, select_backend
from services.model.digits import MODEL_NAME, MODEL_VERSION, NUM_CLASSES, DigitsCNN, model_dir_weights

log = logging.getLogger(__name__)


class DigitsCNNStage(Stage):
    """`INPUT` [N, 1, 8, 8] ink counts (0..16, FP32) → `LOGITS` [N, 10] (FP32).

    The backend is chosen (and the choice logged) at construction, so a bad setting fails before serving;
    the weights are read in `load`.

    Args:
        model_dir: the model repository; weights are read from `<model_dir>/digits_cnn/1/model.pt`.
        backend: "auto", "torch" or "tensorrt" (not in this build yet).
        device: "auto" (CUDA when available), "cpu", "cuda" or "cuda:N".
        torch_threads: torch intra-op threads (process-wide).
    """

    name = MODEL_NAME
    inputs = (TensorSpec("INPUT", "FP32", (-1, 1, 8, 8)),)
    outputs = (TensorSpec("LOGITS", "FP32", (-1, NUM_CLASSES)),)
    max_batch_size = 256
    versions = (MODEL_VERSION,)

    def __init__(
        self,
        model_dir: str | os.PathLike[str] = "models",
        *,
        backend: str = "auto",
        device: str = "auto",
        torch_threads: int = 1,
    ) -> None:
        self.weights = model_dir_weights(model_dir, MODEL_VERSION)
        self.runner: ModelBackend = select_backend(
            backend,
            device,
            build=DigitsCNN,
            weights=self.weights,
            threads=torch_threads,
            example_shape=(1, 8, 8),
        )
        self.platform = self.runner.platform
        self.backend = self.runner.name

    def load(self) -> None:
        """Read the weights onto the device and warm up."""
        self.runner.load()

    def unload(self) -> None:
        """Release the weights."""
        self.runner.unload()

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Logits for a batch."""
        return {"LOGITS": self.runner.infer(inputs["INPUT"])}

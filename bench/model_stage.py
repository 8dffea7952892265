"""The model stage for the scaling benchmark: `minilm_encoder` and `refcnn_cnn` served as plain stage objects.

    python -m bench.model_stage --port 0 [--delay-ms 20]

`--delay-ms` makes a slow replica: every call takes that much longer (the model's thread sleeps, so the
replica answers late without using a core). The benchmark serves these two models through this entry point
rather than `python -m services.model`, so that it measures the router and not the model service's loader.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping

import numpy as np

from pipeline.server import add_server_arguments, run_stage_service
from pipeline.stage import Stage


class Delayed(Stage):
    """A stage that answers `delay` seconds late."""

    def __init__(self, inner: Stage, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.name, self.inputs, self.outputs = inner.name, inner.inputs, inner.outputs
        self.max_batch_size = inner.max_batch_size

    def load(self) -> None:
        self.inner.load()

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(self.delay)
        return self.inner.infer(inputs)


def main() -> None:
    from services.model.minilm import MiniLMEncoderStage
    from services.model.refcnn import RefCNNStage

    parser = argparse.ArgumentParser(description=__doc__)
    add_server_arguments(parser, service="model", default_port=8102)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    stages: list[Stage] = [MiniLMEncoderStage(device="cpu"), RefCNNStage(device="cpu")]
    if args.delay_ms:
        stages = [Delayed(stage, args.delay_ms / 1000) for stage in stages]
    run_stage_service(stages, args, service="model")


if __name__ == "__main__":
    main()

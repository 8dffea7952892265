"""The model service with a delay: a slow replica for the scaling benchmark.

    python -m bench.model_stage --delay-ms 20 [python -m services.model's flags]

Every model execution of this `python -m services.model` takes `--delay-ms` longer: the instance's thread
sleeps before it runs the model, so the replica answers late without using more of a core. Everything else
(the repository, the flags, the protocol) is the model service's own.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

import numpy as np

from pipeline.stage.api import NO_DEADLINE, Deadline
from services.model import __main__ as model_service
from services.model.instances import ArtifactInstance


def main() -> None:
    argv = sys.argv[1:]
    delay = 0.0
    if "--delay-ms" in argv:
        at = argv.index("--delay-ms")
        delay = float(argv[at + 1]) / 1000
        del argv[at : at + 2]
    run = ArtifactInstance.run

    def delayed(
        self: ArtifactInstance, inputs: Mapping[str, np.ndarray], deadline: Deadline = NO_DEADLINE
    ) -> dict[str, np.ndarray]:
        time.sleep(delay)
        return run(self, inputs, deadline)

    ArtifactInstance.run = delayed  # type: ignore[method-assign]
    model_service.main(argv)


if __name__ == "__main__":
    main()

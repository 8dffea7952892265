"""Record TorchServe 0.12's answers to the parity requests (`tests.torchserve.exchange`) into
`torchserve_answers.json`, which `tests/e2e/test_torchserve_parity.py` compares the pipeline's answers with.

    python -m tests.torchserve.record --torchserve-home TS_HOME   # TS_HOME: see tests.torchserve.server

TorchServe runs as `tests.torchserve.server` starts it (ports the OS has free, its model API enabled, token
authorization off, one worker per model by default); the word handler's archive is made by that
environment's `torch-model-archiver`. The server is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tests.torchserve.archive import archive_with_archiver
from tests.torchserve.exchange import ANSWERS, exchange
from tests.torchserve.server import serve, version


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--torchserve-home", type=Path, required=True, help="venv with torchserve 0.12")
    args = parser.parse_args()
    home = args.torchserve_home.resolve()
    with tempfile.TemporaryDirectory(prefix="torchserve-parity-") as folder:
        work = Path(folder)
        store = work / "store"
        archive_with_archiver(home / "bin" / "torch-model-archiver", store)
        with serve(home, store, work) as server:
            answers = exchange(server.inference, server.management)
    served = version(home)
    ANSWERS.write_text(
        json.dumps({"server": "torchserve", "version": served, "answers": answers}, indent=1) + "\n"
    )
    print(f"wrote {ANSWERS} ({len(answers)} answers of TorchServe {served})", file=sys.stderr)


if __name__ == "__main__":
    main()

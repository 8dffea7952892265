"""Work for the HTTP codec's worker processes in tests: a module of its own, light for them to import."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def hold(started: str, release: str) -> str:
    """Say this worker's pid through the FIFO `started`, then wait until the FIFO `release` is written."""
    Path(started).write_text(str(os.getpid()))
    Path(release).read_text()
    return "released"


def pid() -> int:
    return os.getpid()


def die() -> None:
    """What the kernel's OOM killer does to a worker."""
    os.kill(os.getpid(), signal.SIGKILL)

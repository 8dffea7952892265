"""The progress bar `pipeline bench` shows on stderr while it runs."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from pipeline.tools.bench.load import Tally
from pipeline.tools.bench.options import BenchOptions, Level


class Progress:
    """A tqdm bar over the run's seconds, with the level and the responses so far (stderr)."""

    def __init__(self, options: BenchOptions, levels: Sequence[Level]) -> None:
        self.levels = levels
        self.per_level = options.warmup + options.duration
        self.enabled = options.progress
        self.bar: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from tqdm import tqdm

            total = self.per_level * len(self.levels)
            self.bar = tqdm(total=round(total, 1), unit="s", desc="bench", leave=False, file=sys.stderr)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    async def follow(self, index: int, start: float, tally: Tally | None) -> None:
        if self.bar is None:
            return
        while True:
            elapsed = min(self.per_level, max(0.0, time.perf_counter() - start))
            self.bar.n = round(index * self.per_level + elapsed, 1)
            postfix = self.levels[index].label
            if tally is not None:
                postfix += f", {tally.ok} ok, {sum(tally.errors.values())} errors"
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.refresh()
            await asyncio.sleep(0.5)

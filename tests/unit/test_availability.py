"""Which ensembles the router serves: requests for an ensemble that is not available share the router's looks
at its stages (no sockets: the stages are a stand-in whose repository indexes the test holds back)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from pipeline.ensemble.catalog import load_catalog
from pipeline.router.execution.availability import EnsembleAvailability
from pipeline.router.registry import ModelRegistry

CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 4
input [ { name: "X", data_type: TYPE_FP32, dims: [ 3 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 3 ] } ]
ensemble_scheduling {
  step [ { model_name: "scale" model_version: -1 input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y" } } ]
}
"""


class HeldStages:
    """Stages whose `RepositoryIndex` lists nothing, each look counted and held until `answer` is set (the
    part of `StageDiscovery` that a look uses)."""

    def __init__(self) -> None:
        self.clients = {"only": SimpleNamespace(endpoint=SimpleNamespace(address="127.0.0.1:9"))}
        self.indexes: dict[str, dict[str, frozenset[str]]] = {"only": {}}
        self.stage_of_model: dict[str, str] = {}
        self.repository_models: dict[str, str] = {}
        self.looks = 0
        self.looking = asyncio.Event()
        self.answer = asyncio.Event()

    async def refresh_index(self) -> None:
        self.looks += 1
        self.looking.set()
        await self.answer.wait()

    def find_stage(self, model: str) -> str | None:
        return None


def availability_of(tmp_path: Path, stages: HeldStages) -> EnsembleAvailability:
    (tmp_path / "chain").mkdir()
    (tmp_path / "chain" / "config.pbtxt").write_text(CHAIN)
    catalog = load_catalog(repository=tmp_path, stages={"only": "127.0.0.1:9"})
    return EnsembleAvailability(catalog, stages, ModelRegistry())


async def test_calls_waiting_for_a_look_share_the_next_one(tmp_path):
    stages = HeldStages()
    availability = availability_of(tmp_path, stages)
    first = asyncio.ensure_future(availability.complete())
    await stages.looking.wait()  # the first look has begun, and is held
    waiting = [asyncio.ensure_future(availability.complete()) for _ in range(50)]
    stages.answer.set()
    await asyncio.gather(first, *waiting)
    # The 50 came during the first look: one more look serves them all.
    assert stages.looks == 2
    assert "no stage serves model(s) scale" in availability.unavailable["chain"]
    assert "'only' (127.0.0.1:9)" in availability.unavailable["chain"]
    await availability.complete()
    assert stages.looks == 3  # a call after the looks ended gets one of its own

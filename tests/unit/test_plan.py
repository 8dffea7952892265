"""The compiled plan's own behaviour, independent of YAML."""

from __future__ import annotations

import dataclasses
import types

import pytest

from pipeline.ensemble.plan import Catalog, EnsemblePlan, PlanStep, StageEndpoint
from pipeline.protocol.errors import InvalidInput
from pipeline.protocol.types import TensorSpec
from pipeline.router.execution.executor import _first_error


def _plan(name: str, models: dict[str, str]) -> EnsemblePlan:
    steps = tuple(
        PlanStep(i, model, "", stage, (("X", "IN"),), (("Y", f"t{i}"),), ())
        for i, (model, stage) in enumerate(models.items())
    )
    stages = {
        stage: StageEndpoint(stage, f"127.0.0.1:{8100 + n}")
        for n, stage in enumerate(sorted(set(models.values())))
    }
    return EnsemblePlan(
        name=name,
        source=f"{name}.yaml",
        max_batch_size=8,
        inputs=(TensorSpec("IN", "FP32", (-1,)),),
        outputs=(TensorSpec("t0", "FP32", (-1,)),),
        steps=steps,
        stages=types.MappingProxyType(stages),
    )


def test_label_uses_the_yaml_index() -> None:
    step = PlanStep(3, "cnn", "2", "model", (("INPUT", "pixels"),), (("LOGITS", "logits"),), (0, 1))
    assert step.label == "step 3 (cnn)"


def test_plan_objects_are_frozen_and_slotted() -> None:
    step = PlanStep(0, "cnn", "", "model", (), (), ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.index = 1  # type: ignore[misc]
    assert not hasattr(step, "__dict__")


def test_stage_models_across_ensembles() -> None:
    a = _plan("a", {"pre": "cpu", "cnn": "gpu"})
    b = _plan("b", {"cnn": "gpu", "post": "cpu"})
    catalog = Catalog(
        ensembles=types.MappingProxyType({"a": a, "b": b}),
        stages=types.MappingProxyType({**a.stages, **b.stages}),
    )
    assert catalog.stage_models() == {"pre": "cpu", "cnn": "gpu", "post": "cpu"}


def test_a_failed_ensemble_reports_the_step_error_that_says_what_was_wrong():
    said = InvalidInput("IMAGE[2]: cannot decode image")
    group = BaseExceptionGroup("steps", [RuntimeError("bug"), BaseExceptionGroup("inner", [said])])
    assert _first_error(group) is said
    bug = RuntimeError("bug")
    assert _first_error(BaseExceptionGroup("steps", [bug])) is bug

"""Triton's `config.pbtxt` ensembles in both directions: an ensemble plan as Triton's `ModelConfig` (what
`ModelConfig` answers for an ensemble)."""

from __future__ import annotations

import logging

import yaml

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.ensemble.plan import EnsemblePlan
from pipeline.protocol.model_config import model_config

log = logging.getLogger(__name__)


def ensemble_config(plan: EnsemblePlan) -> mc.ModelConfig:
    """Triton's `ModelConfig` of an ensemble: platform "ensemble" and its steps."""
    config = model_config(
        plan.name,
        platform="ensemble",
        max_batch_size=plan.max_batch_size,
        inputs=plan.inputs,
        outputs=plan.outputs,
    )
    for step in sorted(plan.steps, key=lambda s: s.index):
        entry = config.ensemble_scheduling.step.add(
            model_name=step.model_name, model_version=int(step.model_version or -1)
        )
        for stage_tensor, tensor_name in step.inputs:
            entry.input_map[stage_tensor] = tensor_name
        for stage_tensor, tensor_name in step.outputs:
            entry.output_map[stage_tensor] = tensor_name
    # What Triton's ensembles cannot say goes in `parameters`, as a config.pbtxt ensemble writes it.
    if plan.response_cache:
        config.response_cache.enable = True
    switches = {}
    text: dict[str, object]
    for step in plan.steps:
        when = step.when
        if when is None:
            continue
        if when.switch is not None:
            switches[when.switch.name] = when.switch
            text = {"switch": when.switch.name, "case": when.case}
        else:
            assert when.comparison is not None
            text = {"tensor": when.tensor, when.comparison.op: when.comparison.operand}
        config.parameters[f"step.{step.index}.when"].string_value = _flow(text)
    for name, switch in switches.items():
        cases = [{"name": case, comparison.op: comparison.operand} for case, comparison in switch.cases]
        config.parameters[f"switch.{name}"].string_value = _flow({"tensor": switch.tensor, "cases": cases})
    if plan.optional_outputs:
        config.parameters["optional_outputs"].string_value = ",".join(sorted(plan.optional_outputs))
    return config


def _flow(value: object) -> str:
    """YAML flow text on one line, as `ensemble_config` writes conditions into `parameters`."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 16).strip()

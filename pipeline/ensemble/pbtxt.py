"""Triton's `config.pbtxt` ensembles in both directions: a repository's ensembles (`platform: "ensemble"`
with `ensemble_scheduling`) compiled as YAML ensembles are, and a plan as Triton's `ModelConfig` (what
`ModelConfig` answers for an ensemble). What Triton's ensembles cannot say (conditions, switches, fan-out
steps, optional outputs) travels in `parameters`, each value YAML flow text in the YAML files' vocabulary."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import yaml

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.ensemble.compiler import compile_ensemble
from pipeline.ensemble.loader import StrictLoader
from pipeline.ensemble.plan import EnsemblePlan
from pipeline.protocol.config_fields import acted_on
from pipeline.protocol.errors import ConfigError, RepositoryError
from pipeline.protocol.model_config import log_ignored, model_config, tensor_specs
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.repository import ModelRepository

log = logging.getLogger(__name__)

#: The fields of an ensemble's `config.pbtxt` that the router acts on (`pipeline.protocol.config_fields`);
#: any other is logged as ignored.
ENSEMBLE_FIELDS = acted_on("ensemble")


#: `parameters` of an ensemble's `config.pbtxt` that carry what Triton's ensembles cannot say, each value a
#: YAML flow text in the YAML files' vocabulary: `step.<N>.when` (step N's condition), `step.<N>.for_each`
#: (step N's fan-out tensors, comma-separated), `switch.<NAME>` (a switch), and `optional_outputs`
#: (comma-separated names).
_STEP_WHEN = re.compile(r"step\.(\d+)\.when")
_STEP_FOR_EACH = re.compile(r"step\.(\d+)\.for_each")
_SWITCH = re.compile(r"switch\.(.+)")
_OPTIONAL_OUTPUTS = "optional_outputs"


def ensemble_config(plan: EnsemblePlan, *, decoupled: bool = False) -> mc.ModelConfig:
    """Triton's `ModelConfig` of an ensemble: platform "ensemble" and its steps. `decoupled`: a step of it is
    decoupled, so the ensemble answers with any number of responses, and says so as Triton's does
    (`model_transaction_policy { decoupled: true }`)."""
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
    config.ensemble_scheduling.max_inflight_requests = plan.max_inflight_requests
    if decoupled:
        config.model_transaction_policy.decoupled = True
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
    for step in plan.steps:
        if step.for_each:
            config.parameters[f"step.{step.index}.for_each"].string_value = ",".join(step.for_each)
    for name, switch in switches.items():
        cases = [{"name": case, comparison.op: comparison.operand} for case, comparison in switch.cases]
        config.parameters[f"switch.{name}"].string_value = _flow({"tensor": switch.tensor, "cases": cases})
    if plan.optional_outputs:
        config.parameters[_OPTIONAL_OUTPUTS].string_value = ",".join(sorted(plan.optional_outputs))
    return config


def _flow(value: object) -> str:
    """YAML flow text on one line, as `ensemble_config` writes conditions into `parameters`."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 16).strip()


def _extensions(
    config: mc.ModelConfig, source: str
) -> tuple[dict[int, Any], dict[str, Any], set[str], dict[int, list[str]]]:
    """Conditions, switches, optional outputs and fan-out steps from an ensemble config's `parameters`."""
    when: dict[int, Any] = {}
    switches: dict[str, Any] = {}
    optional: set[str] = set()
    for_each: dict[int, list[str]] = {}
    for key, param in sorted(config.parameters.items()):
        text = param.string_value
        if key == _OPTIONAL_OUTPUTS:
            optional.update(name.strip() for name in text.split(",") if name.strip())
            continue
        fan_out = _STEP_FOR_EACH.fullmatch(key)
        if fan_out is not None:
            for_each[int(fan_out.group(1))] = [name.strip() for name in text.split(",") if name.strip()]
            continue
        step, switch = _STEP_WHEN.fullmatch(key), _SWITCH.fullmatch(key)
        if step is None and switch is None:
            log.info("%s: parameter '%s' is not one the router acts on", source, key)
            continue
        try:
            value = yaml.load(text, Loader=StrictLoader)  # a SafeLoader subclass: no arbitrary objects
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: parameter '{key}': invalid YAML: {exc}") from None
        if step is not None:
            when[int(step.group(1))] = value
        elif switch is not None:
            switches[switch.group(1)] = value
    return when, switches, optional, for_each


def compile_model_config(config: mc.ModelConfig, source: str) -> EnsemblePlan:
    """Compile a Triton ensemble (`platform: "ensemble"` with `ensemble_scheduling { step [...] }`) into a
    plan, exactly as a YAML ensemble: it becomes the same schema and goes through the same compiler, so the
    same errors name `source`, the step and the tensor.

    Inputs and outputs come from the config's `input`/`output` (`TYPE_*` datatypes; `dims` without the
    batch dimension when `max_batch_size > 0`). No step names a stage: the router finds each model's.
    """
    try:
        inputs, outputs = tensor_specs(config, source)
    except RepositoryError as exc:
        raise ConfigError(exc.message) from None

    when, switches, optional, for_each = _extensions(config, source)
    steps = config.ensemble_scheduling.step
    for index in when:
        if index >= len(steps):
            raise ConfigError(f"{source}: parameter 'step.{index}.when': there is no step {index}")
    for index in for_each:
        if index >= len(steps):
            raise ConfigError(f"{source}: parameter 'step.{index}.for_each': there is no step {index}")
    declared = {spec.name for spec in outputs}
    for name in optional - declared:
        raise ConfigError(f"{source}: parameter '{_OPTIONAL_OUTPUTS}': there is no output '{name}'")

    def tensors(specs: tuple[TensorSpec, ...]) -> list[dict[str, Any]]:
        return [
            {"name": s.name, "datatype": s.datatype, "shape": list(s.shape)}
            | ({"optional": True} if s.name in optional else {})
            for s in specs
        ]

    data = {
        "name": config.name,
        "max_batch_size": config.max_batch_size,
        "inputs": tensors(inputs),
        "outputs": tensors(outputs),
        "switches": switches,
        "response_cache": {"enable": config.response_cache.enable},
        "max_inflight_requests": config.ensemble_scheduling.max_inflight_requests,
        "steps": [
            {
                "model_name": step.model_name,
                # Triton's -1 (or, unset in the text, 0) is the model's default version.
                "model_version": step.model_version if step.model_version > 0 else -1,
                "input_map": dict(step.input_map),
                "output_map": dict(step.output_map),
            }
            | ({"when": when[i]} if i in when else {})
            | ({"for_each": for_each[i]} if i in for_each else {})
            for i, step in enumerate(steps)
        ],
    }
    return compile_ensemble(data, source, default_name=config.name)


def load_repository_ensembles(
    root: str | os.PathLike[str], *, failed: dict[str, ConfigError] | None = None
) -> list[EnsemblePlan]:
    """Compile every ensemble (`platform: "ensemble"`) of a Triton model repository, sorted by name. One
    that does not compile raises `ConfigError`, or, given `failed`, is put there by name and the others go on.

    An entry the repository cannot read is logged and skipped: it may be a stage's model, which its own
    service refuses with the same message.
    """
    plans = []
    for name, entry in ModelRepository(root).entries({"ensemble"}).items():
        if isinstance(entry, RepositoryError):
            log.warning("model repository %s: skipping model '%s': %s", root, name, entry.message)
            continue
        log_ignored(entry.config, ENSEMBLE_FIELDS, entry.source)
        try:
            plans.append(compile_model_config(entry.config, entry.source))
        except ConfigError as err:
            if failed is None:
                raise
            failed[name] = err
    return plans

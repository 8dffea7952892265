"""An ensemble plan checked against the stage models' real signatures (`ModelSignature`), which the router
learns from `ModelMetadata` at start-up: the last layer of an ensemble's validation."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pipeline.ensemble.plan import EnsemblePlan, ModelSignature, PlanStep
from pipeline.protocol.errors import ConfigError, names_of
from pipeline.protocol.types import TensorSpec

log = logging.getLogger(__name__)


#: Ensemble tensor -> (its spec at a producing end, how messages name that end), one pair per producer.
_Produced = dict[str, list[tuple[TensorSpec, str]]]


def check_signatures(plan: EnsemblePlan, signatures: Mapping[str, ModelSignature]) -> None:
    """Check an ensemble's steps against the stage models' real signatures, keyed by model name.

    Every mapped tensor must exist on the stage model, every stage input must be mapped, and each ensemble
    tensor must have the same datatype and a compatible shape (same rank; each dimension equal or -1 on
    either side) at both ends: ensemble input → step input, step output → step input, step output →
    ensemble output. A batching ensemble needs batching stage models. Raises `ConfigError`
    listing every mismatch.

    A stage model whose metadata lists no tensor (`ModelSignature.declared` false) is accepted with a
    warning: its step is not checked here, and neither are the tensors it produces.
    """
    errors: list[str] = []
    produced: _Produced = {spec.name: [(spec, "an ensemble input")] for spec in plan.inputs}
    known: dict[int, ModelSignature] = {}
    for step in sorted(plan.steps, key=lambda s: s.index):
        signature = signatures.get(step.model_name)
        if signature is None:
            errors.append(
                f"{plan.source}: {step.label}: model '{step.model_name}' is unknown to stage '{step.stage}' "
                f"({_address(plan, step.stage)}); it does not serve a model of that name"
            )
            continue
        if not signature.declared:
            log.warning(
                "%s: %s: stage model '%s' on stage '%s' declares no tensors in its ModelMetadata: its tensors "
                "are checked on its first response instead of now",
                plan.source,
                step.label,
                step.model_name,
                step.stage,
            )
            continue
        known[step.index] = signature
        errors += _interface_errors(plan, step, signature)
        stage_outputs = {spec.name: spec for spec in signature.outputs}
        for stage_tensor, tensor in step.outputs:
            if stage_tensor in stage_outputs:
                produced.setdefault(tensor, []).append(
                    (stage_outputs[stage_tensor], f"produced by {step.label} output '{stage_tensor}'")
                )
    errors += _input_mismatches(plan, known, produced)
    errors += _condition_mismatches(plan, produced)
    errors += _output_mismatches(plan, produced)
    if errors:
        raise ConfigError("\n".join(errors))


def _interface_errors(plan: EnsemblePlan, step: PlanStep, signature: ModelSignature) -> list[str]:
    """A step's maps against its stage model's tensors: every mapped tensor exists, every input is mapped,
    and a batching ensemble's model batches."""
    errors: list[str] = []
    where = f"{plan.source}: {step.label}"
    if plan.max_batch_size > 0 and signature.max_batch_size == 0:
        errors.append(
            f"{where}: the ensemble batches (max_batch_size {plan.max_batch_size}) but stage model "
            f"'{step.model_name}' does not (max_batch_size 0); set the ensemble's max_batch_size to 0"
        )
    if step.for_each and (signature.max_batch_size == 0 or signature.decoupled):
        why = "is decoupled" if signature.decoupled else "does not batch (max_batch_size 0)"
        errors.append(
            f"{where}: for_each sends each element of {', '.join(step.for_each)} as a request of one item, "
            f"but stage model '{step.model_name}' {why}"
        )
    stage_inputs = {spec.name for spec in signature.inputs}
    stage_outputs = {spec.name for spec in signature.outputs}
    for stage_tensor, tensor in step.inputs:
        if stage_tensor not in stage_inputs:
            errors.append(
                f"{where}: input_map maps '{stage_tensor}' ← tensor '{tensor}', "
                f"but the stage model has no input '{stage_tensor}' "
                f"(its inputs: {_names(signature.inputs)})"
            )
    mapped = {stage_tensor for stage_tensor, _ in step.inputs}
    unmapped = [spec for spec in signature.inputs if spec.name not in mapped]
    if len(unmapped) == 1:
        spec = unmapped[0]
        errors.append(
            f"{where}: stage input '{spec.name}' ({spec.datatype} {list(spec.shape)}) is not mapped; "
            f"add it to input_map (mapped now: {names_of(sorted(mapped))})"
        )
    elif unmapped:
        errors.append(
            f"{where}: stage inputs {names_of(spec.name for spec in unmapped)} are not mapped; add them to "
            f"input_map (mapped now: {names_of(sorted(mapped))})"
        )
    for stage_tensor, tensor in step.outputs:
        if stage_tensor not in stage_outputs:
            errors.append(
                f"{where}: output_map maps '{stage_tensor}' → tensor '{tensor}', but the stage model has "
                f"no output '{stage_tensor}' (its outputs: {_names(signature.outputs)})"
            )
    return errors


def _input_mismatches(
    plan: EnsemblePlan, known: Mapping[int, ModelSignature], produced: _Produced
) -> list[str]:
    """Each checked step's inputs against every producer of the tensor mapped to them."""
    errors: list[str] = []
    by_index = {step.index: step for step in plan.steps}
    for index, signature in known.items():
        step = by_index[index]
        input_specs = {spec.name: spec for spec in signature.inputs}
        for stage_tensor, tensor in step.inputs:
            if stage_tensor not in input_specs or tensor not in produced:
                # Reported already: an unknown input, or a producer that is unknown or lacks the output.
                continue
            for source_spec, origin in produced[tensor]:
                mismatch = _mismatch(input_specs[stage_tensor], "expected by the stage", source_spec, tensor)
                if mismatch:
                    errors.append(
                        f"{plan.source}: {step.label}: input '{stage_tensor}' ← tensor '{tensor}': "
                        f"{mismatch} ({origin})"
                    )
    return errors


def _condition_mismatches(plan: EnsemblePlan, produced: _Produced) -> list[str]:
    """Conditions that compare a BYTES tensor with a number, or a numeric one with a string."""
    errors: list[str] = []
    for step in sorted(plan.steps, key=lambda s: s.index):
        if step.when is None or step.when.tensor not in produced:
            continue
        strings = {isinstance(operand, str) for operand in step.when.operands}
        for source_spec, origin in produced[step.when.tensor]:
            if source_spec.datatype == "BYTES" and False in strings:
                kind = "compares it with a number"
            elif source_spec.datatype != "BYTES" and True in strings:
                kind = "compares it with a string"
            else:
                continue
            errors.append(
                f"{plan.source}: {step.label}: condition on tensor '{step.when.tensor}': the tensor is "
                f"{source_spec.datatype} ({origin}) but the condition {kind}; strings compare with BYTES "
                "tensors only, numbers with numeric ones"
            )
    return errors


def _output_mismatches(plan: EnsemblePlan, produced: _Produced) -> list[str]:
    """The ensemble's outputs as declared against every step output that produces them."""
    errors: list[str] = []
    ensemble_inputs = {spec.name for spec in plan.inputs}
    for spec in plan.outputs:
        if spec.name not in produced or spec.name in ensemble_inputs:
            continue
        for source_spec, origin in produced[spec.name]:
            mismatch = _mismatch(spec, "declared by the ensemble", source_spec, spec.name)
            if mismatch:
                errors.append(f"{plan.source}: ensemble output '{spec.name}': {mismatch} ({origin})")
    return errors


def _mismatch(expected: TensorSpec, expected_by: str, found: TensorSpec, tensor: str) -> str:
    if expected.datatype != found.datatype:
        return f"datatype {expected.datatype} {expected_by}, but '{tensor}' is {found.datatype}"
    if len(expected.shape) != len(found.shape):
        return (
            f"shape {list(expected.shape)} (rank {len(expected.shape)}) {expected_by}, but '{tensor}' has "
            f"shape {list(found.shape)} (rank {len(found.shape)})"
        )
    for i, (want, got) in enumerate(zip(expected.shape, found.shape, strict=True)):
        if want != got and -1 not in (want, got):
            return (
                f"shape {list(expected.shape)} {expected_by}, but '{tensor}' has shape {list(found.shape)} "
                f"(dimension {i}: {want} vs {got})"
            )
    return ""


def _names(specs: tuple[TensorSpec, ...]) -> str:
    return names_of(spec.name for spec in specs)


def _address(plan: EnsemblePlan, stage: str) -> str:
    endpoint = plan.stages.get(stage)
    return endpoint.address if endpoint is not None else "undeclared"

"""A sequence batch as its model gets and gives it: each row's inputs with the control inputs and the state
of its sequence (`add_inputs`), the rows merged into the batch's inputs and its outputs split back into rows
(`pipeline.protocol.tensor_batch`, the rule every batch follows), for the sequence batcher
(`pipeline.stage.sequence_batcher`) and the model's runner."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pipeline.protocol.datatypes import DATATYPES
from pipeline.protocol.errors import InvalidInput, PipelineError
from pipeline.protocol.sequences import SequenceId
from pipeline.protocol.tensor_batch import BatchShapeError, merge_arrays, split_arrays
from pipeline.stage.sequence_config import CONTROL, Control, SequenceSettings


@dataclass(frozen=True)
class Row:
    """One request of a batch as the model's code sees it: its inputs (one row each, control and state
    inputs included), its sequence id and Triton's request flags."""

    inputs: dict[str, np.ndarray]
    correlation_id: int | str
    flags: int


def add_inputs(
    settings: SequenceSettings,
    model: str,
    arrays: dict[str, np.ndarray],
    sequence: SequenceId | None,
    state: Mapping[str, np.ndarray] | None,
) -> dict[str, np.ndarray]:
    """A row's inputs with its control inputs and its state (`sequence` None: a padding row)."""
    lead = (1, 1) if settings.batching else (1,)
    for control in settings.controls:
        if control.kind == CONTROL.CONTROL_SEQUENCE_CORRID:
            arrays[control.name] = corrid(control, sequence, model).reshape(lead)
            continue
        if sequence is None:
            on = False
        elif control.kind == CONTROL.CONTROL_SEQUENCE_START:
            on = sequence.start
        elif control.kind == CONTROL.CONTROL_SEQUENCE_END:
            on = sequence.end
        else:
            on = True
        value = control.values[1 if on else 0]
        arrays[control.name] = np.full(lead, value, DATATYPES[control.datatype])
    for spec in settings.states:
        current = state[spec.input_name] if state is not None else spec.initial
        arrays[spec.input_name] = current[np.newaxis] if settings.batching else current
    return arrays


def no_state(model: str, missing: list[str], sequence: SequenceId) -> PipelineError:
    return PipelineError(
        f"model '{model}' returned no state output {', '.join(missing)} for sequence {sequence.value}"
    )


def corrid(control: Control, sequence: SequenceId | None, model: str) -> np.ndarray:
    value = 0 if sequence is None else sequence.value
    if control.datatype == "BYTES":
        return np.array([str(value).encode() if value else b""], dtype=object)
    if isinstance(value, str):
        raise InvalidInput(
            f"sequence id '{value}' is a string, but model '{model}' takes its CONTROL_SEQUENCE_CORRID "
            f"'{control.name}' as {control.datatype}: send a number"
        )
    dtype = DATATYPES[control.datatype]
    if value > np.iinfo(dtype).max:
        raise InvalidInput(
            f"sequence id {value} does not fit model '{model}''s CONTROL_SEQUENCE_CORRID '{control.name}' "
            f"({control.datatype})"
        )
    return np.array([value], dtype)


def merge_rows(rows: list[dict[str, np.ndarray]], batching: bool) -> dict[str, np.ndarray]:
    """The batch's inputs: the rows' inputs one after another (the one row's, for a model that does not
    batch)."""
    return merge_arrays(rows) if batching else rows[0]


def one_row(array: np.ndarray, batching: bool) -> np.ndarray:
    """A row's own tensor, without the batch dimension where the model batches."""
    return np.asarray(array[0]) if batching else np.asarray(array)


def split_rows(outputs: Mapping[str, np.ndarray], count: int, batching: bool) -> list[dict[str, np.ndarray]]:
    """A batch's outputs, one dict per row (the whole outputs for a model that does not batch)."""
    if not batching:
        return [dict(outputs)]
    try:
        return split_arrays(outputs, [1] * count)
    except BatchShapeError as err:
        raise PipelineError(str(err)) from None

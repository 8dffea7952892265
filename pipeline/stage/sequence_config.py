"""Triton's `sequence_batching` settings, read from a model's config and checked: the strategy and its
delays, the control inputs and their values, the implicit state and where it starts. `SequenceSettings.of`
refuses, naming the field, what this server does not serve (`iterative_sequence`, a decoupled model, a
response cache, a control input without its values or one that is also a declared input)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.datatypes import DATATYPES
from pipeline.protocol.errors import RepositoryError
from pipeline.protocol.model_config import datatype_of_config

#: Triton's default `max_sequence_idle_microseconds`.
DEFAULT_IDLE_S = 1.0
#: The config parameter that bounds the sequences waiting for a slot (Triton has no bound); a START past it
#: is refused at once with UNAVAILABLE, as a request past a full `max_queue_size` is.
MAX_BACKLOG_PARAMETER = "pipeline.max_sequence_backlog"
#: Sequences that may wait for a slot, per model version, where the config does not say (the router's
#: default `max_queue_size` too).
DEFAULT_MAX_BACKLOG = 1024
#: The kinds of control signal.
CONTROL = mc.ModelSequenceBatching.Control
_CORRID_TYPES = {
    mc.TYPE_UINT64: "UINT64",
    mc.TYPE_INT64: "INT64",
    mc.TYPE_UINT32: "UINT32",
    mc.TYPE_INT32: "INT32",
    mc.TYPE_STRING: "BYTES",
}


@dataclass(frozen=True)
class Control:
    """One control signal of a control input: its kind and the values it takes."""

    name: str
    kind: int
    datatype: str
    #: (false, true) for START, END and READY.
    values: tuple[object, object] = (0, 1)


@dataclass(frozen=True)
class StateSpec:
    """An implicit state: the input the model reads it from, the output it writes it to, and its start."""

    input_name: str
    output_name: str
    datatype: str
    initial: np.ndarray


@dataclass(frozen=True)
class SequenceSettings:
    """A model's `sequence_batching`, read and checked."""

    strategy: str
    #: Sequences one instance holds at once.
    slots: int
    #: Rows of a batch (1 for a model that does not batch).
    max_batch_size: int
    #: Whether the model's tensors have a batch dimension.
    batching: bool
    delay_s: float
    preferred: tuple[int, ...]
    minimum_slot_utilization: float
    idle_s: float
    #: Sequences that may wait for a slot (`MAX_BACKLOG_PARAMETER`).
    max_backlog: int
    controls: tuple[Control, ...]
    states: tuple[StateSpec, ...]

    @classmethod
    def of(cls, config: mc.ModelConfig, source: str, folder: Path | None = None) -> SequenceSettings:
        """A config's sequence batching; `RepositoryError` naming the field for what is not served.
        `folder`: the model's folder, where `initial_state` data files are."""
        batching = config.sequence_batching
        where = f"{source}: sequence_batching"
        if batching.iterative_sequence:
            raise RepositoryError(
                f"{where}: iterative_sequence is not supported by this server (a decoupled model's requests "
                "rescheduled as a sequence); remove it"
            )
        if config.response_cache.enable:
            raise RepositoryError(
                f"{where}: response_cache is enabled, but a sequence's answers depend on its state, not on the "
                "request alone: a cached response would replay another sequence's; disable response_cache"
            )
        if config.model_transaction_policy.decoupled:
            raise RepositoryError(
                f"{where}: a decoupled model (model_transaction_policy) is not served with sequence batching here"
            )
        rows = max(1, config.max_batch_size)
        strategy = batching.WhichOneof("strategy_choice") or "direct"
        if strategy == "oldest":
            oldest = batching.oldest
            slots = oldest.max_candidate_sequences or rows
            delay = oldest.max_queue_delay_microseconds
            preferred = tuple(sorted(set(oldest.preferred_batch_size)))
            if any(size < 1 or size > rows for size in preferred):
                raise RepositoryError(
                    f"{where}: oldest.preferred_batch_size {list(preferred)} must lie within 1..{rows} "
                    "(max_batch_size)"
                )
            utilization = 0.0
        else:
            slots = rows
            delay = batching.direct.max_queue_delay_microseconds
            preferred = ()
            utilization = batching.direct.minimum_slot_utilization
        declared = {t.name for t in config.input}
        controls = tuple(_controls(batching, declared, where))
        states = tuple(_state(state, declared, where, folder) for state in batching.state)
        idle = batching.max_sequence_idle_microseconds
        return cls(
            strategy=strategy,
            slots=slots,
            max_batch_size=rows,
            batching=config.max_batch_size > 0,
            delay_s=delay / 1e6,
            preferred=preferred,
            minimum_slot_utilization=utilization,
            idle_s=idle / 1e6 if idle else DEFAULT_IDLE_S,
            max_backlog=_max_backlog(config, source),
            controls=controls,
            states=states,
        )


def _max_backlog(config: mc.ModelConfig, source: str) -> int:
    if MAX_BACKLOG_PARAMETER not in config.parameters:
        return DEFAULT_MAX_BACKLOG
    text = config.parameters[MAX_BACKLOG_PARAMETER].string_value
    value = text.strip()
    if not (value.isascii() and value.isdigit() and int(value) >= 1):
        raise RepositoryError(
            f"{source}: parameters: {MAX_BACKLOG_PARAMETER} is {text!r}; expected an integer >= 1 (the sequences "
            "that may wait for a sequence slot)"
        )
    return int(value)


def _controls(batching: mc.ModelSequenceBatching, declared: set[str], where: str) -> list[Control]:
    found: list[Control] = []
    kinds: set[int] = set()
    for control_input in batching.control_input:
        name = control_input.name
        if not name:
            raise RepositoryError(f"{where}: a control_input has no name")
        if name in declared:
            raise RepositoryError(
                f"{where}: control input '{name}' is also declared as an input; the server gives it to the model"
            )
        if len(control_input.control) != 1:
            raise RepositoryError(
                f"{where}: control input '{name}' has {len(control_input.control)} controls; one is supported"
            )
        control = control_input.control[0]
        kind_name = CONTROL.Kind.Name(control.kind)
        if control.kind in kinds:
            raise RepositoryError(f"{where}: {kind_name} is given by more than one control input")
        kinds.add(control.kind)
        if control.kind == CONTROL.CONTROL_SEQUENCE_CORRID:
            datatype = _CORRID_TYPES.get(control.data_type)
            if datatype is None:
                raise RepositoryError(
                    f"{where}: control input '{name}' (CONTROL_SEQUENCE_CORRID) has data_type "
                    f"{mc.DataType.Name(control.data_type)}; expected TYPE_UINT64, TYPE_INT64, TYPE_UINT32, "
                    "TYPE_INT32 or TYPE_STRING"
                )
            found.append(Control(name, control.kind, datatype))
            continue
        forms = [
            (form, datatype, list(getattr(control, form)))
            for form, datatype in (
                ("int32_false_true", "INT32"),
                ("fp32_false_true", "FP32"),
                ("bool_false_true", "BOOL"),
            )
            if len(getattr(control, form))
        ]
        if len(forms) != 1 or len(forms[0][2]) != 2:
            raise RepositoryError(
                f"{where}: control input '{name}' ({kind_name}) must give its false and true values in exactly "
                "one of int32_false_true, fp32_false_true or bool_false_true (two values)"
            )
        _, datatype, values = forms[0]
        found.append(Control(name, control.kind, datatype, (values[0], values[1])))
    return found


def _state(
    state: mc.ModelSequenceBatching.State, declared: set[str], where: str, folder: Path | None
) -> StateSpec:
    if not state.input_name or not state.output_name:
        raise RepositoryError(f"{where}: a state needs both input_name and output_name")
    if state.input_name in declared:
        raise RepositoryError(
            f"{where}: state input '{state.input_name}' is also declared as an input; the server gives it to "
            "the model"
        )
    datatype = datatype_of_config(state.data_type)
    name = f"state '{state.input_name}'"
    if len(state.initial_state) > 1:
        raise RepositoryError(
            f"{where}: {name} has {len(state.initial_state)} initial_state entries; one is supported"
        )
    if not state.initial_state:
        # As Triton: a variable dimension is 1 on a sequence's first request (whose state the model makes).
        dims = [1 if d < 0 else d for d in state.dims]
        return StateSpec(state.input_name, state.output_name, datatype, _zeros(datatype, dims))
    initial = state.initial_state[0]
    if initial.data_type not in (mc.TYPE_INVALID, state.data_type):
        raise RepositoryError(
            f"{where}: {name} initial_state has data_type {mc.DataType.Name(initial.data_type)}, the state "
            f"{mc.DataType.Name(state.data_type)}"
        )
    dims = list(initial.dims) or list(state.dims)
    if any(d < 0 for d in dims):
        raise RepositoryError(f"{where}: {name} initial_state dims {dims} must be fixed")
    if len(dims) != len(state.dims) or any(s not in (-1, d) for s, d in zip(state.dims, dims, strict=True)):
        raise RepositoryError(
            f"{where}: {name} initial_state dims {dims} do not fit the state's dims {list(state.dims)}"
        )
    choice = initial.WhichOneof("state_data")
    if choice == "data_file":
        if folder is None:
            raise RepositoryError(f"{where}: {name} initial_state data_file needs a model repository")
        root = (folder / "initial_state").resolve()
        path = (root / initial.data_file).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise RepositoryError(
                f"{where}: {name} initial_state data_file '{initial.data_file}' is not a file in {root}"
            )
        if datatype == "BYTES":
            raise RepositoryError(f"{where}: {name} initial_state data_file is not supported for TYPE_STRING")
        data = path.read_bytes()
        dtype = DATATYPES[datatype]
        expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        if len(data) != expected:
            raise RepositoryError(
                f"{where}: {name} initial_state data_file {path} has {len(data)} bytes; dims {dims} of "
                f"{datatype} take {expected}"
            )
        array = np.frombuffer(data, dtype).reshape(dims).copy()
        return StateSpec(state.input_name, state.output_name, datatype, array)
    return StateSpec(state.input_name, state.output_name, datatype, _zeros(datatype, dims))


def _zeros(datatype: str, dims: Sequence[int]) -> np.ndarray:
    if datatype == "BYTES":
        return np.full(tuple(dims), b"", dtype=object)
    return np.zeros(tuple(dims), DATATYPES[datatype])


def sequence_tensors(config: mc.ModelConfig) -> tuple[list[mc.ModelInput], list[mc.ModelOutput]]:
    """The tensors a sequence batcher adds to a model's, as config tensors: its control inputs and state
    inputs, and the state outputs the config does not list as outputs. A backend that binds the tensors of a
    model file to the config's binds these too (the model file must have them)."""
    batching = config.sequence_batching
    inputs = []
    for control_input in batching.control_input:
        for control in control_input.control[:1]:
            if control.kind == CONTROL.CONTROL_SEQUENCE_CORRID:
                data_type = control.data_type
            elif len(control.int32_false_true):
                data_type = mc.TYPE_INT32
            elif len(control.fp32_false_true):
                data_type = mc.TYPE_FP32
            else:
                data_type = mc.TYPE_BOOL
            inputs.append(mc.ModelInput(name=control_input.name, data_type=data_type, dims=[1]))
    declared = {t.name for t in config.output}
    outputs = []
    for state in batching.state:
        inputs.append(mc.ModelInput(name=state.input_name, data_type=state.data_type, dims=state.dims))
        if state.output_name not in declared:
            outputs.append(mc.ModelOutput(name=state.output_name, data_type=state.data_type, dims=state.dims))
    return inputs, outputs

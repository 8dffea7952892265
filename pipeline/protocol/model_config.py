"""Triton's model configuration (`inference.ModelConfig`, `config.pbtxt`): the rules every service and the
router read it by, in one place. Its text format, its datatypes, the tensors it declares, the `parameters`
this project gives a meaning to (`pad_value.<TENSOR>`, `deterministic`, `pipeline.<batching knob>`), its
version policy and `dynamic_batching`."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import cast

from google.protobuf import text_format

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import RepositoryError, RepositoryNotFound
from pipeline.protocol.types import BatchingConfig, TensorSpec

log = logging.getLogger(__name__)

#: `ModelConfig.parameters` key prefix under which a model declares a tensor's `TensorSpec.pad_value`.
PAD_VALUE_PARAMETER = "pad_value."

#: `ModelConfig.parameters` key by which a model says whether the same request always gets the same answer
#: (`"false"`: it may not, so its responses must never be cached).
DETERMINISTIC_PARAMETER = "deterministic"

#: `ModelConfig.parameters` keys of the router's batching knobs that Triton's `dynamic_batching` has no field
#: for (`BatchingConfig` says what each does), read where the config sets `dynamic_batching`: `true` or
#: `false` for the flags, an integer >= 1 for `max_inflight_batches` (default: one batch per instance).
BATCHING_PARAMETERS = ("pipeline.batch_upcoming", "pipeline.idle_dispatch", "pipeline.max_inflight_batches")
_DEFAULTS = BatchingConfig()

# ---- the text format ------------------------------------------------------------------------------------------
_PARSE_POSITION = re.compile(r"^(\d+):(\d+) : (.*)$", re.DOTALL)


def parse_config(text: str, source: str) -> mc.ModelConfig:
    """A `ModelConfig` from Triton's text format; `RepositoryError` naming `source`, the line and the cause."""
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        match = _PARSE_POSITION.match(str(exc))
        where, cause = (
            (f"line {match.group(1)}, column {match.group(2)}", match.group(3)) if match else ("", str(exc))
        )
        raise RepositoryError(f"{source}: {where + ': ' if where else ''}{cause}") from None
    return config


def read_config(path: str | os.PathLike[str]) -> mc.ModelConfig:
    """Read and parse a `config.pbtxt`; `RepositoryError` for a file that cannot be read or parsed."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RepositoryError(f"{path}: cannot read it: {exc}") from None
    return parse_config(text, str(path))


def config_text(config: mc.ModelConfig) -> str:
    """A `ModelConfig` in Triton's text format, as `config.pbtxt` holds it."""
    return text_format.MessageToString(config)


def datatype_of_config(data_type: int) -> str:
    """The protocol datatype (`FP32`, `BYTES`, ...) of a config `data_type` (`TYPE_FP32`, `TYPE_STRING`, ...)."""
    name = mc.DataType.Name(data_type)
    if name == "TYPE_INVALID":
        raise ValueError("data_type is not set")
    return "BYTES" if name == "TYPE_STRING" else name[len("TYPE_") :]


def config_datatype(datatype: str) -> mc.DataType:
    """The config `data_type` of a protocol datatype."""
    # The stubs type enum values as plain int; the message fields take the enum type.
    return cast(mc.DataType, mc.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"))


def tensor_specs(
    config: mc.ModelConfig, source: str = ""
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The inputs and outputs a config declares, as clients see them: for a batching model
    (`max_batch_size > 0`) the batch dimension -1 comes first. `RepositoryError` for a tensor without a name,
    a datatype or dims."""
    where = source or f"model '{config.name}'"
    pads = pad_values(config)
    batch = (-1,) if config.max_batch_size > 0 else ()

    def specs(tensors: Iterable[mc.ModelInput | mc.ModelOutput], kind: str) -> tuple[TensorSpec, ...]:
        found = []
        for index, tensor in enumerate(tensors):
            if not tensor.name:
                raise RepositoryError(f"{where}: {kind} {index} has no name")
            try:
                datatype = datatype_of_config(tensor.data_type)
                spec = TensorSpec(
                    tensor.name,
                    datatype,
                    (*batch, *tensor.dims),
                    pad_value=pads.get(tensor.name),
                    optional=bool(getattr(tensor, "optional", False)),
                )
            except ValueError as exc:
                raise RepositoryError(f"{where}: {kind} '{tensor.name}': {exc}") from None
            found.append(spec)
        return tuple(found)

    return specs(config.input, "input"), specs(config.output, "output")


def set_tensor_specs(
    config: mc.ModelConfig, inputs: Iterable[TensorSpec], outputs: Iterable[TensorSpec]
) -> None:
    """Write `inputs` and `outputs` (shapes as clients see them) into `config`, replacing what it declares;
    `config.max_batch_size` must be set first (it says whether shapes carry a batch dimension)."""
    skip = 1 if config.max_batch_size > 0 else 0
    del config.input[:]
    del config.output[:]
    for spec in inputs:
        config.input.add(
            name=spec.name,
            data_type=config_datatype(spec.datatype),
            dims=spec.shape[skip:],
            allow_ragged_batch=spec.pad_value is not None,
            optional=spec.optional,
        )
    for spec in outputs:
        config.output.add(name=spec.name, data_type=config_datatype(spec.datatype), dims=spec.shape[skip:])
    for spec in (*inputs, *outputs):
        if spec.pad_value is not None:
            config.parameters[PAD_VALUE_PARAMETER + spec.name].string_value = repr(spec.pad_value)


def parameters_of(config: mc.ModelConfig) -> dict[str, str]:
    """A config's `parameters` as plain strings."""
    return {key: param.string_value for key, param in config.parameters.items()}


def check_response_cache(config: mc.ModelConfig, source: str) -> None:
    """Refuse a config that enables `response_cache` for a model it declares non-deterministic
    (`parameters { key: "deterministic" value { string_value: "false" } }`)."""
    if config.response_cache.enable and not is_deterministic(config):
        raise RepositoryError(
            f"{source}: response_cache is enabled, but the model declares itself non-deterministic (parameter "
            'deterministic: "false"): a cached response would replay one of its answers for requests that '
            "should get fresh ones; disable response_cache or drop the parameter"
        )


#: The warning a service logs at load for the top-level fields of a config it does not act on
#: (`pipeline.protocol.config_fields` lists those each kind of model acts on).
IGNORED_MESSAGE = "%s: ignoring field(s) this service does not act on: %s"


def log_ignored(config: mc.ModelConfig, acted_on: Collection[str], source: str) -> list[str]:
    """Log (and return) the top-level fields a config sets that the service does not act on."""
    ignored = sorted(field.name for field, _ in config.ListFields() if field.name not in acted_on)
    if ignored:
        log.warning(IGNORED_MESSAGE, source, ", ".join(ignored))
    return ignored


def select_versions(policy: mc.ModelVersionPolicy, available: Iterable[str], source: str) -> list[str]:
    """The versions a `version_policy` serves out of `available` (numeric folder names), oldest first.

    Triton's default is the newest version alone (`latest { num_versions: 1 }`).
    """
    ordered = sorted(set(available), key=int)
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return ordered
    if choice == "specific":
        wanted = sorted({str(v) for v in policy.specific.versions}, key=int)
        missing = [v for v in wanted if v not in ordered]
        if missing:
            raise RepositoryNotFound(
                f"{source}: version_policy names version(s) {', '.join(missing)}, which have no folder "
                f"(found: {', '.join(ordered) or 'none'})"
            )
        return wanted
    count = policy.latest.num_versions if choice == "latest" else 1
    return ordered[-max(count, 1) :]


def model_config(
    name: str,
    *,
    platform: str,
    backend: str = "",
    max_batch_size: int,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    parameters: Mapping[str, str] | None = None,
) -> mc.ModelConfig:
    """Triton's `ModelConfig` for a model. Dims leave out the batch dimension when the model batches."""
    config = mc.ModelConfig(name=name, platform=platform, backend=backend, max_batch_size=max_batch_size)
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = value
    set_tensor_specs(config, inputs, outputs)
    return config


def pad_values(config: mc.ModelConfig) -> dict[str, float]:
    """The pad values a stage published in its `ModelConfig`, by tensor name."""
    return {
        key[len(PAD_VALUE_PARAMETER) :]: float(param.string_value)
        for key, param in config.parameters.items()
        if key.startswith(PAD_VALUE_PARAMETER)
    }


def is_deterministic(config: mc.ModelConfig) -> bool:
    """Whether a model's config leaves it deterministic (anything but `deterministic: "false"`)."""
    param = config.parameters.get(DETERMINISTIC_PARAMETER)
    return param is None or param.string_value.strip().lower() != "false"


def batching_of_config(config: mc.ModelConfig) -> BatchingConfig | None:
    """The router's batching of a model whose `ModelConfig` sets Triton's `dynamic_batching`, with the
    model's `max_batch_size` as the largest batch, one batch in flight per instance of the model
    (`instance_group`: `count` on each GPU it lists) on each replica, and the knobs Triton has no field for
    from `parameters` (`BATCHING_PARAMETERS`); None where it sets none or the model does not batch. Raises
    `ValueError` for settings that do not fit together (a preferred size above max_batch_size) and for a
    knob's value that is not one."""
    if config.WhichOneof("scheduling_choice") != "dynamic_batching" or config.max_batch_size <= 0:
        return None
    batching = config.dynamic_batching
    policy = batching.default_queue_policy
    instances = max(1, sum(g.count * max(1, len(g.gpus)) for g in config.instance_group))
    return BatchingConfig(
        max_batch_size=config.max_batch_size,
        max_queue_delay_microseconds=batching.max_queue_delay_microseconds,
        preferred_batch_size=tuple(batching.preferred_batch_size),
        max_queue_size=policy.max_queue_size,
        default_timeout_microseconds=policy.default_timeout_microseconds,
        allow_timeout_override=policy.allow_timeout_override,
        priority_levels=batching.priority_levels,
        default_priority_level=batching.default_priority_level,
        preserve_ordering=batching.preserve_ordering,
        max_inflight_batches=int(_knob(config, "pipeline.max_inflight_batches", instances)),
        idle_dispatch=bool(_knob(config, "pipeline.idle_dispatch", _DEFAULTS.idle_dispatch)),
        batch_upcoming=bool(_knob(config, "pipeline.batch_upcoming", _DEFAULTS.batch_upcoming)),
    )


def _knob(config: mc.ModelConfig, key: str, default: bool | int) -> bool | int:
    """A batching knob from the config's `parameters` (`default` where it is not there): a flag's `true` or
    `false`, else an integer >= 1."""
    if key not in config.parameters:
        return default
    text = config.parameters[key].string_value
    value = text.strip().lower()
    if isinstance(default, bool):
        if value not in ("true", "false"):
            raise ValueError(f"parameter '{key}' is {text!r}; expected true or false")
        return value == "true"
    if not (value.isascii() and value.isdigit() and int(value) >= 1):
        raise ValueError(f"parameter '{key}' is {text!r}; expected an integer >= 1")
    return int(value)

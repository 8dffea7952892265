"""Ensembles: load, validate, and compile into the immutable plan of `pipeline.ensemble.plan`.

Two front ends feed one compiler. An ensemble YAML file uses Triton's vocabulary: `inputs`, `outputs` and
`steps`, each step calling a stage model and mapping its tensors with `input_map` / `output_map` (stage
tensor name: ensemble tensor name). Stage endpoints are declared once under `stages` and referred to by key;
a step that names none is served by whichever of the router's stages serves its model. Triton's own
definition, a repository model's `config.pbtxt` with `platform: "ensemble"` and `ensemble_scheduling`,
becomes the same schema (`compile_model_config`). Data dependencies define the DAG.

Validation happens in three layers, each raising `ConfigError` with the file, the step and the tensor:

1. the schema (pydantic, unknown keys rejected, values typed) - `compile_ensemble`;
2. the graph (one producer per tensor, everything consumed is produced, no cycle) - `compile_ensemble`;
3. the stages' real signatures, learnt from `ModelMetadata` at start-up - `check_signatures` (defined in
   `pipeline.ensemble.plan`, re-exported here).
"""

from __future__ import annotations

import difflib
import heapq
import itertools
import logging
import math
import os
import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.ensemble.plan import (
    COMPARISONS,
    Catalog,
    Comparison,
    Condition,
    EnsemblePlan,
    ModelSignature,
    PlanStep,
    StageEndpoint,
    Switch,
    check_signatures,
)
from pipeline.protocol.datatypes import DATATYPES
from pipeline.protocol.errors import ConfigError, RepositoryError
from pipeline.protocol.model_config import log_ignored, tensor_specs
from pipeline.protocol.types import BatchingConfig, TensorSpec
from pipeline.runtime.repository import ModelRepository

__all__ = [
    "ConfigError",
    "ModelSignature",
    "build_catalog",
    "check_signatures",
    "compile_ensemble",
    "compile_model_config",
    "load_catalog",
    "load_ensemble",
    "load_ensembles",
    "load_repository_ensembles",
    "stage_endpoints",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# Schema

Name = Annotated[str, StringConstraints(strict=True, min_length=1)]

# `${VAR}` or `${VAR:-default}`; anything else starting with `${` is reported as malformed.
_ENV_REFERENCE = re.compile(r"\$\{([^}]*)\}?")
_ENV_BODY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+(?:%[\w.-]+)?\]|[A-Za-z0-9_.-]+):(\d{1,5})")
# gRPC target schemes that have no `host:port` form, passed through as they are.
_GRPC_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorConfig(_Schema):
    """An ensemble input or output as written in YAML."""

    name: Name
    datatype: Name
    shape: tuple[Annotated[int, Field(strict=True)], ...]
    #: Outputs only: a request may lack it, because no step produces it on some path of the conditions.
    optional: bool = False

    @field_validator("datatype")
    @classmethod
    def _known_datatype(cls, value: str) -> str:
        if value not in DATATYPES:
            hint = f"; write '{value[5:]}', not '{value}'" if value.startswith("TYPE_") else ""
            raise ValueError(f"unknown datatype '{value}' (expected one of {', '.join(DATATYPES)}){hint}")
        return value

    @field_validator("shape")
    @classmethod
    def _valid_dims(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        for i, dim in enumerate(value):
            if dim < -1:
                raise ValueError(f"dimension {i} is {dim}; dimensions must be -1 (variable) or >= 0")
        return value


PositiveInt = Annotated[int, Field(strict=True, ge=1)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]


class DynamicBatchingConfig(_Schema):
    """Triton's `dynamic_batching` for a stage model, as written in YAML (see `pipeline.router.batching`)."""

    max_batch_size: PositiveInt = 64
    max_queue_delay_microseconds: NonNegativeInt = 1000
    preferred_batch_size: tuple[PositiveInt, ...] = ()
    max_queue_size: NonNegativeInt = 1024
    default_timeout_microseconds: NonNegativeInt = 0
    allow_timeout_override: bool = True
    priority_levels: NonNegativeInt = 0
    default_priority_level: NonNegativeInt = 0
    preserve_ordering: bool = False
    max_inflight_batches: PositiveInt = 1  # per ready replica of the stage
    idle_dispatch: bool = True
    batch_upcoming: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> DynamicBatchingConfig:
        self.compile()  # BatchingConfig checks how the knobs fit together
        return self

    def compile(self) -> BatchingConfig:
        return BatchingConfig(**self.model_dump())


class StageConfig(_Schema):
    """A stage endpoint as written in YAML; `address` may use `${VAR}` and `${VAR:-default}`.

    `dynamic_batching` applies to every step of this file that calls the stage, unless the step sets its own.
    """

    address: Name
    dynamic_batching: DynamicBatchingConfig | None = None
    #: Stage calls in flight at once (a batch counts as one); 0 = no limit. Bounds the router's memory and
    #: the stage's load for unbatched steps as `max_inflight_batches` does for batched ones.
    max_inflight_requests: NonNegativeInt = 0

    @field_validator("address")
    @classmethod
    def _expand_address(cls, value: str, info: ValidationInfo) -> str:
        environ: Mapping[str, str] = (info.context or {}).get("environ", os.environ)
        address = _expand(value, environ).strip()
        if not address:
            raise ValueError(f"address {value!r} is empty after expanding environment variables")
        if address.startswith(_GRPC_SCHEMES):
            return address
        match = _HOST_PORT.fullmatch(address)
        if match is None or not 1 <= int(match.group(1)) <= 65535:
            expanded = f" (from {value!r})" if address != value else ""
            raise ValueError(
                f"address {address!r}{expanded} is not of the form host:port, [ipv6]:port or unix:path"
            )
        return address


Number = StrictInt | StrictFloat
Operand = StrictInt | StrictFloat | StrictStr


class _ComparisonConfig(_Schema):
    """Exactly one comparison of a request's single value with a constant. Strings compare for equality
    only (a BYTES tensor's element, as UTF-8); numbers compare every way."""

    equals: Operand | None = None
    not_equals: Operand | None = None
    greater_than: Number | None = None
    greater_equal: Number | None = None
    less_than: Number | None = None
    less_equal: Number | None = None

    def comparisons(self) -> list[Comparison]:
        return [
            Comparison(op, float(value) if not isinstance(value, str) else value)
            for op in COMPARISONS
            if (value := getattr(self, op)) is not None
        ]

    def comparison(self) -> Comparison:
        found = self.comparisons()
        if len(found) != 1:
            given = ", ".join(c.op for c in found) or "none"
            raise ValueError(f"give exactly one comparison ({', '.join(COMPARISONS)}); given: {given}")
        return found[0]


class WhenConfig(_ComparisonConfig):
    """When a step runs: `{tensor: T, <comparison>: value}`, or `{switch: S, case: C}` (a case of a switch
    declared under `switches`, or its `default`)."""

    tensor: Name | None = None
    switch: Name | None = None
    case: Name | None = None

    @model_validator(mode="after")
    def _one_form(self) -> WhenConfig:
        if self.switch is not None or self.case is not None:
            if self.switch is None or self.case is None:
                raise ValueError("a switch's branch names both 'switch' and 'case'")
            if self.tensor is not None or self.comparisons():
                raise ValueError(
                    "give either {switch, case} or {tensor, <comparison>}, not both (the switch names its "
                    "tensor and compares it)"
                )
            return self
        if self.tensor is None:
            raise ValueError("missing 'tensor' (the tensor whose single value the condition reads)")
        self.comparison()
        return self


class CaseConfig(_ComparisonConfig):
    """A switch's case: its name and one comparison."""

    name: Name

    @model_validator(mode="after")
    def _valid(self) -> CaseConfig:
        if self.name == "default":
            raise ValueError("'default' is the name of the branch no case takes; give the case another name")
        self.comparison()
        return self


class SwitchConfig(_Schema):
    """A switch on one tensor's single value: the cases are tried in order, the first that holds is taken,
    `default` when none does. Steps choose a branch with `when: {switch: NAME, case: CASE}`."""

    tensor: Name
    cases: tuple[CaseConfig, ...] = Field(min_length=1)

    @field_validator("cases")
    @classmethod
    def _unique(cls, cases: tuple[CaseConfig, ...]) -> tuple[CaseConfig, ...]:
        names = [case.name for case in cases]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"case name(s) {', '.join(twice)} given more than once")
        return cases


class ResponseCacheConfig(_Schema):
    """Triton's `response_cache { enable: true }`."""

    enable: bool = False


class StepConfig(_Schema):
    """An ensemble step as written in YAML."""

    model_name: Name
    #: -1 = the stage's default version. A string is accepted too (OIP versions are strings on the wire),
    #: but only a numeric one: Triton's `ensemble_scheduling.step.model_version` is an int64.
    model_version: int | str = -1
    #: A key of `stages`; without it the router finds the stage that serves the model (`RepositoryIndex`).
    stage: Name | None = None
    input_map: dict[Name, Name]
    output_map: dict[Name, Name]
    #: Overrides the stage's `dynamic_batching` for this step's model; `false` turns batching off.
    dynamic_batching: DynamicBatchingConfig | Literal[False] | None = None
    #: The step runs only for the requests that meet this condition (and have all its inputs).
    when: WhenConfig | None = None

    @field_validator("model_version", mode="plain")
    @classmethod
    def _valid_version(cls, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"model_version must be an integer or a string, not {value!r}")
        if isinstance(value, int) and value != -1 and value < 1:
            raise ValueError(f"model_version must be -1 (the default version) or >= 1, not {value}")
        if isinstance(value, str):
            if not value:
                raise ValueError(
                    "model_version must not be an empty string (omit it for the default version)"
                )
            text = value.strip()
            # NOTE: ASCII digits only: str.isdigit() also takes '²' and other digits int() refuses.
            number = int(text) if text.isascii() and text.lstrip("-").isdigit() else None
            if number is None or (number != -1 and number < 1) or number >= 2**63:
                raise ValueError(
                    f"model_version must be a version number (-1 for the default version, or >= 1), "
                    f"not {value!r}: model versions are numbered folders, as in Triton"
                )
            return number
        if value >= 2**63:
            raise ValueError(f"model_version {value} is too large (Triton's versions are int64)")
        return value


class EnsembleConfig(_Schema):
    """A whole ensemble file as written in YAML."""

    #: Defaults to the file's stem.
    name: Name | None = None
    max_batch_size: Annotated[int, Field(strict=True, ge=0)] = 64
    #: May be left out when no step names a stage (the router's own stages, `--stage`, serve them).
    stages: dict[Name, StageConfig] = Field(default_factory=dict)
    inputs: tuple[TensorConfig, ...]
    outputs: tuple[TensorConfig, ...]
    steps: tuple[StepConfig, ...]
    #: Switches that steps' `when` name, by name.
    switches: dict[Name, SwitchConfig] = Field(default_factory=dict)
    #: Cache whole responses of this ensemble in the router (its `--cache-size`).
    response_cache: ResponseCacheConfig = Field(default_factory=ResponseCacheConfig)


def _expand(value: str, environ: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        body = _ENV_BODY.fullmatch(match.group(1))
        if body is None or not match.group(0).endswith("}"):
            raise ValueError(
                f"malformed environment reference {match.group(0)!r}: use ${{VAR}} or ${{VAR:-default}}"
            )
        name, default = body.group(1), body.group(2)
        found = environ.get(name)
        # Like the shell's `:-`, an empty variable counts as unset when there is a default.
        if found is None or (found == "" and default is not None):
            if default is None:
                raise ValueError(
                    f"environment variable '{name}' is not set and has no default "
                    f"(set it, or write ${{{name}:-host:port}})"
                )
            return default
        return found

    return _ENV_REFERENCE.sub(replace, value)


# ----------------------------------------------------------------------------------------------------------
# YAML and pydantic errors, in words


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of silently keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, str | int | float | bool) and key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"duplicate key {key!r} (first at line {seen[key].start_mark.line + 1})",
                key_node.start_mark,
            )
        if isinstance(key, str | int | float | bool):
            seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

_ALLOWED_KEYS: dict[str, type[_Schema]] = {
    "inputs": TensorConfig,
    "outputs": TensorConfig,
    "steps": StepConfig,
    "stages": StageConfig,
    "switches": SwitchConfig,
}


def _read_yaml(path: Path, source: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the file: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: byte {exc.start}: not UTF-8 text (YAML files are UTF-8)") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        detail = f"{problem} ({context})" if context else problem
        raise ConfigError(f"{source}: {where}invalid YAML: {detail}") from exc


def _context(loc: tuple[Any, ...], raw: Mapping[str, Any]) -> str:
    """`step N (model_name): ` or `input 'X': ` for a location inside a list item, else ''."""
    if len(loc) < 2 or loc[0] not in ("steps", "inputs", "outputs") or not isinstance(loc[1], int):
        return ""
    items = raw.get(loc[0])
    if not isinstance(items, list) or loc[1] >= len(items) or not isinstance(items[loc[1]], dict):
        return ""
    item = items[loc[1]]
    if loc[0] == "steps":
        return f"step {loc[1]} ({item.get('model_name', '?')}): "
    name = item.get("name")
    return f"{'input' if loc[0] == 'inputs' else 'output'} '{name}': " if name is not None else ""


def _path(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part == "[key]":
            text += " (key)"
        else:
            text += f".{part}" if text else str(part)
    return text or "top level"


# pydantic's words for Python types, in YAML's words.
_TYPE_WORDS = {
    "tuple_type": "a list",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
}


def _explain(error: Any, raw: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        parent = loc[:-1]
        model = EnsembleConfig if not parent else _ALLOWED_KEYS.get(parent[0]) if len(parent) == 2 else None
        allowed = f" (allowed: {', '.join(model.model_fields)})" if model is not None else ""
        return f"{_context(loc, raw)}{_path(parent)}: unknown key '{loc[-1]}'{allowed}"
    if kind == "missing":
        return f"{_context(loc, raw)}{_path(loc[:-1])}: missing required key '{loc[-1]}'"
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind in _TYPE_WORDS:
        message = f"must be {_TYPE_WORDS[kind]}, found {_kind(error['input'])}"
    elif kind == "string_too_short":
        message = "must not be empty"
    return f"{_context(loc, raw)}{_path(loc)}: {message}"


# ----------------------------------------------------------------------------------------------------------
# Compilation


def compile_ensemble(
    data: Any, source: str, *, default_name: str | None = None, environ: Mapping[str, str] | None = None
) -> EnsemblePlan:
    """Validate an ensemble already parsed from YAML (a mapping) and compile it into a plan.

    `source` names the origin in messages; `default_name` is the name when the data has none (the file's
    stem for `load_ensemble`). `environ` (default `os.environ`) expands `${VAR}` in stage addresses.
    """
    if data is None:
        raise ConfigError(
            f"{source}: the file is empty; expected a mapping with stages, inputs, outputs, steps"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: the top level must be a mapping (name, stages, inputs, outputs, steps), "
            f"found {_kind(data)}"
        )
    try:
        config = EnsembleConfig.model_validate(
            data, context={"environ": os.environ if environ is None else environ}
        )
    except ValidationError as exc:
        lines = [f"{source}: {_explain(error, data)}" for error in exc.errors()]
        raise ConfigError("\n".join(lines)) from None
    name = config.name or default_name
    if not name:
        raise ConfigError(f"{source}: missing required key 'name' (there is no file name to default to)")
    return _Compiler(config, name, source).compile()


def _kind(value: Any) -> str:
    """What a YAML value is, in YAML's words."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    return f"a {type(value).__name__} ({value!r})"


@dataclass(frozen=True, slots=True)
class _Producer:
    """Who produces an ensemble tensor: a step's output, or the ensemble's input when `step` is None."""

    step: int | None
    stage_tensor: str


class _Compiler:
    """Checks the graph of one validated ensemble and builds its plan; collects every error it finds."""

    def __init__(self, config: EnsembleConfig, name: str, source: str) -> None:
        self.config = config
        self.name = name
        self.source = source
        self.errors: list[str] = []

    def fail(self, message: str) -> None:
        self.errors.append(f"{self.source}: {message}")

    def _batching(self, index: int) -> BatchingConfig | None:
        step = self.config.steps[index]
        if step.dynamic_batching is False:
            return None
        chosen = step.dynamic_batching
        if chosen is None and step.stage is not None:
            stage = self.config.stages.get(step.stage)
            chosen = stage.dynamic_batching if stage is not None else None
        return None if chosen is None else chosen.compile()

    def compile(self) -> EnsemblePlan:
        config = self.config
        inputs = self._tensors(config.inputs, "input")
        outputs = self._tensors(config.outputs, "output")
        for tensor in inputs.keys() & outputs.keys():
            self.fail(
                f"tensor '{tensor}' is both an ensemble input and an ensemble output; "
                f"give the output another name (a step must produce it)"
            )
        if not config.steps:
            self.fail("steps: there are no steps; an ensemble needs at least one")
        labels = [f"step {i} ({step.model_name})" for i, step in enumerate(config.steps)]
        for tensor in inputs:
            if any(t.name == tensor and t.optional for t in config.inputs):
                self.fail(f"ensemble input '{tensor}': 'optional' applies to outputs only")
        conditions = [self._condition(i, labels[i]) for i in range(len(config.steps))]
        conditional = any(condition is not None for condition in conditions)
        for name in config.switches.keys() - {c.switch.name for c in conditions if c and c.switch}:
            logger.warning("%s: switch '%s' is not used by any step", self.source, name)

        producers: dict[str, list[_Producer]] = {tensor: [_Producer(None, tensor)] for tensor in inputs}
        for i, step in enumerate(config.steps):
            if step.stage is not None and step.stage not in config.stages:
                declared = ", ".join(sorted(config.stages)) or "none"
                self.fail(
                    f"{labels[i]}: stage '{step.stage}' is not declared under 'stages' (declared: {declared})"
                )
            if step.model_name == self.name:
                self.fail(
                    f"{labels[i]}: model_name '{step.model_name}' is the ensemble's own name; the router "
                    f"serves ensembles and stage models in one namespace"
                )
            if not step.input_map:
                self.fail(
                    f"{labels[i]}: input_map is empty; map at least one stage input to an ensemble tensor"
                )
            if not step.output_map:
                self.fail(
                    f"{labels[i]}: output_map is empty; map at least one stage output to an ensemble tensor"
                )
            for stage_tensor, tensor in step.output_map.items():
                previous = producers.get(tensor)
                if previous is None:
                    producers[tensor] = [_Producer(i, stage_tensor)]
                elif previous[0].step is None:
                    self.fail(
                        f"{labels[i]}: output '{stage_tensor}' → tensor '{tensor}': "
                        f"'{tensor}' is an ensemble input, and a tensor can have only one producer"
                    )
                elif not conditional or previous[-1].step == i:
                    last = previous[-1]
                    assert last.step is not None
                    self.fail(
                        f"{labels[i]}: output '{stage_tensor}' → tensor '{tensor}': '{tensor}' is already "
                        f"produced by {labels[last.step]} output '{last.stage_tensor}'; "
                        f"a tensor can have only one producer"
                        + ("" if last.step == i else " (unless the producers' conditions exclude each other)")
                    )
                else:
                    # Checked below, path by path: the producers must never run for the same request.
                    previous.append(_Producer(i, stage_tensor))

        depends_on: list[tuple[int, ...]] = []
        consumed: set[str] = set()
        for i, step in enumerate(config.steps):
            deps: set[int] = set()
            needed: list[tuple[str | None, str]] = list(step.input_map.items())
            condition = conditions[i]
            if condition is not None:
                needed.append((None, condition.tensor))
            for reader, tensor in needed:
                consumed.add(tensor)
                found = producers.get(tensor)
                if found is None:
                    close = difflib.get_close_matches(tensor, list(producers), n=1)
                    hint = f"; did you mean '{close[0]}'?" if close else ""
                    what = "condition" if reader is None else f"input '{reader}' ←"
                    self.fail(
                        f"{labels[i]}: {what} tensor '{tensor}': "
                        f"nothing produces '{tensor}' (it is neither an ensemble input nor any step's output)"
                        f"{hint}"
                    )
                    continue
                deps.update(producer.step for producer in found if producer.step is not None)
            depends_on.append(tuple(sorted(deps)))

        for tensor in outputs:
            if tensor in inputs:
                continue
            producer = producers.get(tensor)
            if producer is None:
                close = difflib.get_close_matches(
                    tensor, [t for t, p in producers.items() if p[0].step is not None], n=1
                )
                hint = f"; did you mean '{close[0]}'?" if close else ""
                self.fail(
                    f"ensemble output '{tensor}': no step produces it "
                    f"(no output_map maps to '{tensor}'){hint}"
                )

        if self.errors:
            raise ConfigError("\n".join(self.errors))

        order = self._topological_order(depends_on, labels)
        if self.errors:
            raise ConfigError("\n".join(self.errors))
        optional = frozenset(t.name for t in config.outputs if t.optional)
        if conditional:
            self._check_paths(order, conditions, labels, inputs, outputs, optional)
            if self.errors:
                raise ConfigError("\n".join(self.errors))

        for tensor in inputs.keys() - consumed - outputs.keys():
            logger.warning("%s: ensemble input '%s' is not used by any step", self.source, tensor)
        for tensor, found in producers.items():
            for source in found:
                if source.step is not None and tensor not in consumed and tensor not in outputs:
                    logger.info(
                        "%s: %s output '%s' → tensor '%s' is not used",
                        self.source,
                        labels[source.step],
                        source.stage_tensor,
                        tensor,
                    )

        steps = tuple(
            PlanStep(
                index=i,
                model_name=config.steps[i].model_name,
                model_version=_version(config.steps[i].model_version),
                stage=config.steps[i].stage or "",
                inputs=tuple(config.steps[i].input_map.items()),
                outputs=tuple(config.steps[i].output_map.items()),
                depends_on=depends_on[i],
                batching=self._batching(i),
                model_batching=config.steps[i].dynamic_batching is not False,
                when=conditions[i],
            )
            for i in order
        )
        stages = {
            key: StageEndpoint(key, stage.address, stage.max_inflight_requests)
            for key, stage in config.stages.items()
        }
        return EnsemblePlan(
            name=self.name,
            source=self.source,
            max_batch_size=config.max_batch_size,
            inputs=tuple(inputs.values()),
            outputs=tuple(outputs.values()),
            steps=steps,
            stages=types.MappingProxyType(stages),
            optional_outputs=optional,
            response_cache=config.response_cache.enable,
        )

    def _condition(self, index: int, label: str) -> Condition | None:
        """A step's `when`, with the switch it names looked up."""
        when = self.config.steps[index].when
        if when is None:
            return None
        if when.switch is None:
            assert when.tensor is not None
            return Condition(when.tensor, comparison=when.comparison())
        switch = self.config.switches.get(when.switch)
        if switch is None:
            declared = ", ".join(sorted(self.config.switches)) or "none"
            self.fail(
                f"{label}: when: switch '{when.switch}' is not declared under 'switches' (declared: {declared})"
            )
            return None
        cases = tuple((case.name, case.comparison()) for case in switch.cases)
        if when.case not in {name for name, _ in cases} | {"default"}:
            names = ", ".join([name for name, _ in cases] + ["default"])
            self.fail(f"{label}: when: switch '{when.switch}' has no case '{when.case}' (its cases: {names})")
            return None
        return Condition(switch.tensor, switch=Switch(when.switch, switch.tensor, cases), case=when.case)

    def _check_paths(
        self,
        order: list[int],
        conditions: list[Condition | None],
        labels: list[str],
        inputs: Mapping[str, TensorSpec],
        outputs: Mapping[str, TensorSpec],
        optional: frozenset[str],
    ) -> None:
        """Follow every path a request can take through the conditions: on each, no tensor may have two
        producers that run, and every ensemble output that is not optional must be produced.

        The paths are the combinations of one value per condition tensor, taken from a few values that
        stand for every other: each constant compared with, one on either side of it, and one between each
        pair (for strings: each string and one other). Every outcome the conditions can have is among them.
        """
        operands: dict[str, set[float | str]] = {}
        for i, condition in enumerate(conditions):
            if condition is None:
                continue
            kinds = operands.setdefault(condition.tensor, set())
            kinds.update(condition.operands)
            if len({isinstance(v, str) for v in kinds}) > 1:
                self.fail(
                    f"{labels[i]}: conditions on tensor '{condition.tensor}' compare it with strings and with "
                    "numbers; a tensor holds one or the other"
                )
                return
        samples = {tensor: _samples(values) for tensor, values in operands.items()}
        paths = math.prod(len(values) for values in samples.values())
        if paths > _MAX_PATHS:
            self.fail(
                f"the conditions make {paths} paths to check (more than {_MAX_PATHS}); use fewer condition "
                "tensors or fewer distinct constants"
            )
            return
        reported: set[tuple[str, ...]] = set()
        tensors = list(samples)
        for values in itertools.product(*(samples[t] for t in tensors)):
            world = dict(zip(tensors, values, strict=True))
            exists = set(inputs)
            producer_of: dict[str, tuple[int, str]] = {}
            ran: list[int] = []
            for i in order:
                step = self.config.steps[i]
                condition = conditions[i]
                needed = set(step.input_map.values()) | ({condition.tensor} if condition else set())
                if not needed <= exists or (
                    condition is not None and not condition.holds(world[condition.tensor])
                ):
                    continue
                ran.append(i)
                for stage_tensor, tensor in step.output_map.items():
                    first = producer_of.get(tensor)
                    if first is not None and (tensor, str(first[0]), str(i)) not in reported:
                        reported.add((tensor, str(first[0]), str(i)))
                        self.fail(
                            f"{labels[i]}: output '{stage_tensor}' → tensor '{tensor}': '{tensor}' is also "
                            f"produced by {labels[first[0]]} output '{first[1]}', and both run {_path_words(world, ran, labels)}; "
                            "a tensor may have several producers only on branches whose conditions exclude "
                            "each other (a switch's cases, or complementary comparisons)"
                        )
                    producer_of.setdefault(tensor, (i, stage_tensor))
                    exists.add(tensor)
            for tensor in outputs:
                if tensor not in exists and tensor not in optional and (tensor,) not in reported:
                    reported.add((tensor,))
                    self.fail(
                        f"ensemble output '{tensor}': no step produces it {_path_words(world, ran, labels)}; "
                        "produce it on every path, or declare it 'optional: true'"
                    )

    def _tensors(self, configs: tuple[TensorConfig, ...], kind: str) -> dict[str, TensorSpec]:
        specs: dict[str, TensorSpec] = {}
        if not configs:
            self.fail(f"{kind}s: the ensemble declares no {kind}s; it needs at least one")
        for position, tensor in enumerate(configs):
            where = f"ensemble {kind} '{tensor.name}' ({kind}s[{position}])"
            if tensor.name in specs:
                self.fail(f"{where}: the name '{tensor.name}' is declared twice among the ensemble {kind}s")
                continue
            if self.config.max_batch_size > 0 and (not tensor.shape or tensor.shape[0] != -1):
                self.fail(
                    f"{where}: shape {list(tensor.shape)} must start with -1, the batch dimension, because "
                    f"the ensemble batches (max_batch_size {self.config.max_batch_size}); "
                    f"set max_batch_size: 0 for an ensemble that does not batch"
                )
            specs[tensor.name] = TensorSpec(tensor.name, tensor.datatype, tensor.shape)
        return specs

    def _topological_order(self, depends_on: list[tuple[int, ...]], labels: list[str]) -> list[int]:
        """Kahn's algorithm taking the lowest YAML index among ready steps, so ties keep the YAML order."""
        waiting = [len(deps) for deps in depends_on]
        dependents: list[list[int]] = [[] for _ in depends_on]
        for i, deps in enumerate(depends_on):
            for dep in deps:
                dependents[dep].append(i)
        ready = [i for i, count in enumerate(waiting) if count == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for dependent in dependents[i]:
                waiting[dependent] -= 1
                if waiting[dependent] == 0:
                    heapq.heappush(ready, dependent)
        if len(order) < len(depends_on):
            self.fail(self._describe_cycle(set(range(len(depends_on))) - set(order), depends_on, labels))
        return order

    def _describe_cycle(
        self, remaining: set[int], depends_on: list[tuple[int, ...]], labels: list[str]
    ) -> str:
        # Every step left over by Kahn's algorithm waits on another left-over step, so walking back along
        # producers from any of them must come round to a step already seen: that loop is a cycle.
        path: list[int] = []
        seen: dict[int, int] = {}
        current = min(remaining)
        while current not in seen:
            seen[current] = len(path)
            path.append(current)
            current = min(dep for dep in depends_on[current] if dep in remaining)
        cycle = path[seen[current] :]
        cycle.reverse()  # now producer before consumer
        start = cycle.index(min(cycle))  # start from the earliest step in the file, for a stable message
        cycle = cycle[start:] + cycle[:start]
        cycle.append(cycle[0])
        hops = [labels[cycle[0]]]
        for producer, consumer in itertools.pairwise(cycle):
            tensor = next(
                t
                for t in self.config.steps[consumer].input_map.values()
                if t in self.config.steps[producer].output_map.values()
            )
            hops.append(f"'{tensor}' → {labels[consumer]}")
        if len(cycle) == 2:
            return f"{labels[cycle[0]]} consumes its own output: {' → '.join(hops)}; this is a cycle"
        return f"the steps form a cycle: {' → '.join(hops)}"


#: The most paths through the conditions the compiler checks one by one.
_MAX_PATHS = 4096


def _samples(operands: set[float | str]) -> list[float | str]:
    """Values of a condition tensor that between them give every outcome comparisons with `operands` can
    have: each constant, one below the smallest, one above the largest, one between each pair (strings:
    each, and one equal to none)."""
    if any(isinstance(v, str) for v in operands):
        strings = sorted(str(v) for v in operands)
        return [*strings, "\x00" + "".join(strings)]  # longer than any: equal to none
    numbers = sorted(float(v) for v in operands)
    values = [numbers[0] - 1.0]
    for low, high in itertools.pairwise(numbers):
        values += [low, (low + high) / 2]
    return [*values, numbers[-1], numbers[-1] + 1.0]


def _path_words(world: Mapping[str, float | str], ran: list[int], labels: list[str]) -> str:
    values = ", ".join(f"'{tensor}' is {value!r}" for tensor, value in world.items())
    steps = ", ".join(labels[i] for i in ran) or "none"
    return f"for a request where {values} (the steps that run: {steps})"


def _describe(batching: BatchingConfig | None, model_batching: bool) -> str:
    if batching is None:
        return "the model's own (none set)" if model_batching else "off"
    return f"({batching})"


def _version(value: int | str) -> str:
    return "" if value == -1 else str(value)


# ----------------------------------------------------------------------------------------------------------
# Triton's ensemble definition (config.pbtxt)

#: The fields of an ensemble's `config.pbtxt` that the router acts on; any other is logged as ignored.
ENSEMBLE_FIELDS = frozenset(
    {
        "name",
        "platform",
        "backend",
        "max_batch_size",
        "input",
        "output",
        "ensemble_scheduling",
        "response_cache",
        "parameters",
    }
)

#: `parameters` of an ensemble's `config.pbtxt` that carry what Triton's ensembles cannot say, each value a
#: YAML flow text in the YAML files' vocabulary: `step.<N>.when` (step N's condition), `switch.<NAME>` (a
#: switch), and `optional_outputs` (comma-separated names).
_STEP_WHEN = re.compile(r"step\.(\d+)\.when")
_SWITCH = re.compile(r"switch\.(.+)")
_OPTIONAL_OUTPUTS = "optional_outputs"


def _extensions(config: mc.ModelConfig, source: str) -> tuple[dict[int, Any], dict[str, Any], set[str]]:
    """Conditions, switches and optional outputs from an ensemble config's `parameters`."""
    when: dict[int, Any] = {}
    switches: dict[str, Any] = {}
    optional: set[str] = set()
    for key, param in sorted(config.parameters.items()):
        text = param.string_value
        if key == _OPTIONAL_OUTPUTS:
            optional.update(name.strip() for name in text.split(",") if name.strip())
            continue
        step, switch = _STEP_WHEN.fullmatch(key), _SWITCH.fullmatch(key)
        if step is None and switch is None:
            logger.info("%s: parameter '%s' is not one the router acts on", source, key)
            continue
        try:
            value = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: parameter '{key}': invalid YAML: {exc}") from None
        if step is not None:
            when[int(step.group(1))] = value
        elif switch is not None:
            switches[switch.group(1)] = value
    return when, switches, optional


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

    when, switches, optional = _extensions(config, source)
    steps = config.ensemble_scheduling.step
    for index in when:
        if index >= len(steps):
            raise ConfigError(f"{source}: parameter 'step.{index}.when': there is no step {index}")
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
        "steps": [
            {
                "model_name": step.model_name,
                # Triton's -1 (or, unset in the text, 0) is the model's default version.
                "model_version": step.model_version if step.model_version > 0 else -1,
                "input_map": dict(step.input_map),
                "output_map": dict(step.output_map),
            }
            | ({"when": when[i]} if i in when else {})
            for i, step in enumerate(steps)
        ],
    }
    return compile_ensemble(data, source, default_name=config.name)


def load_repository_ensembles(root: str | os.PathLike[str]) -> list[EnsemblePlan]:
    """Compile every ensemble (`platform: "ensemble"`) of a Triton model repository, sorted by name.

    An entry the repository cannot read is logged and skipped: it may be a stage's model, which its own
    service refuses with the same message.
    """
    plans = []
    for name, entry in ModelRepository(root).entries({"ensemble"}).items():
        if isinstance(entry, RepositoryError):
            logger.warning("model repository %s: skipping model '%s': %s", root, name, entry.message)
            continue
        log_ignored(entry.config, ENSEMBLE_FIELDS, entry.source)
        plans.append(compile_model_config(entry.config, entry.source))
    return plans


def stage_endpoints(
    addresses: Mapping[str, str], *, environ: Mapping[str, str] | None = None
) -> dict[str, StageEndpoint]:
    """Stage endpoints given to the router by key (`--stage NAME=ADDRESS`), each address checked as an
    ensemble file's `stages` entry is."""
    endpoints = {}
    for key, address in addresses.items():
        try:
            stage = StageConfig.model_validate(
                {"address": address}, context={"environ": os.environ if environ is None else environ}
            )
        except ValidationError as exc:
            causes = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
            raise ConfigError(f"stage '{key}': {causes}") from None
        endpoints[key] = StageEndpoint(key, stage.address)
    return endpoints


# ----------------------------------------------------------------------------------------------------------
# Files


def load_ensemble(path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> EnsemblePlan:
    """Load, validate and compile one ensemble file; its name defaults to the file's stem.

    `environ` (default `os.environ`) expands `${VAR}` and `${VAR:-default}` in stage addresses.
    """
    source = os.fspath(path)
    file = Path(source)
    return compile_ensemble(_read_yaml(file, source), source, default_name=file.stem, environ=environ)


def _ensemble_files(paths_or_dir: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[str]:
    if isinstance(paths_or_dir, str | os.PathLike):
        paths_or_dir = [paths_or_dir]
    files: list[str] = []
    for entry in paths_or_dir:
        entry_path = Path(entry)
        if entry_path.is_dir():
            found = sorted(p for p in entry_path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
            if not found:
                raise ConfigError(f"{os.fspath(entry)}: the directory has no *.yaml or *.yml ensemble files")
            files.extend(os.fspath(p) for p in found)
        else:
            files.append(os.fspath(entry))
    return files


def load_ensembles(
    paths_or_dir: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    environ: Mapping[str, str] | None = None,
) -> Catalog:
    """Load every ensemble of a directory (its `*.yaml` and `*.yml`, sorted) or of a list of files and dirs.

    Checks what no single file can (see `build_catalog`).
    """
    files = _ensemble_files(paths_or_dir)
    if not files:
        raise ConfigError("no ensemble files given")
    return build_catalog([load_ensemble(file, environ=environ) for file in files])


def load_catalog(
    ensembles: Iterable[str | os.PathLike[str]] = (),
    *,
    repository: str | os.PathLike[str] | None = None,
    stages: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Catalog:
    """What the router serves: the YAML ensembles of `ensembles` (files or folders), the `config.pbtxt`
    ensembles of the model `repository`, and the stage endpoints `stages` (key: address) beside those the
    YAML files declare."""
    plans = [load_ensemble(file, environ=environ) for file in _ensemble_files(ensembles)]
    if repository is not None:
        plans += load_repository_ensembles(repository)
    endpoints = stage_endpoints(stages or {}, environ=environ)
    if not plans and not endpoints:
        raise ConfigError(
            "nothing to serve: no ensemble files, no ensemble in the model repository, and no stages"
        )
    return build_catalog(plans, endpoints)


def build_catalog(
    plans: Iterable[EnsemblePlan], stages: Mapping[str, StageEndpoint] | None = None
) -> Catalog:
    """A catalog of compiled ensembles (from YAML files and model repositories alike) and the router's own
    `stages`. Checks what no single file can: unique ensemble names, one address per stage key, one stage
    per model name, one batching setting per model, and no ensemble named like a stage model (the router
    serves both in one namespace).
    """
    plans = list(plans)
    ensembles: dict[str, EnsemblePlan] = {}
    endpoints: dict[str, tuple[StageEndpoint, str]] = {
        key: (endpoint, "--stage") for key, endpoint in (stages or {}).items()
    }
    models: dict[str, tuple[str, str, str]] = {}  # model name -> (stage, file, step label)
    # model name -> (its batching, whether the model's own applies, where)
    batching: dict[str, tuple[BatchingConfig | None, bool, str]] = {}
    errors: list[str] = []
    for plan in plans:
        if plan.name in ensembles:
            errors.append(
                f"{plan.source}: ensemble '{plan.name}' is also defined in {ensembles[plan.name].source}; "
                f"ensemble names must be unique"
            )
        else:
            ensembles[plan.name] = plan
        for key, endpoint in plan.stages.items():
            first, first_file = endpoints.get(key, (None, ""))
            if first is None or (first_file == "--stage" and first.address == endpoint.address):
                # A file may say more of a stage given by `--stage` (its limits).
                endpoints[key] = (endpoint, plan.source)
            elif first.address != endpoint.address:
                errors.append(
                    f"{plan.source}: stage '{key}' has address '{endpoint.address}', "
                    f"but {first_file} declares it with address '{first.address}'; "
                    "a stage key must name one endpoint"
                )
            elif first.max_inflight_requests != endpoint.max_inflight_requests:
                errors.append(
                    f"{plan.source}: stage '{key}' has max_inflight_requests {endpoint.max_inflight_requests}, "
                    f"but {first_file} declares {first.max_inflight_requests}; a stage has one limit"
                )
        for step in sorted(plan.steps, key=lambda s: s.index):
            where = f"{plan.source} ({step.label})"
            first_batching, first_model, first_where = batching.setdefault(
                step.model_name, (step.batching, step.model_batching, where)
            )
            if (first_batching, first_model) != (step.batching, step.model_batching):
                errors.append(
                    f"{where}: model '{step.model_name}' has dynamic_batching "
                    f"{_describe(step.batching, step.model_batching)} here but "
                    f"{_describe(first_batching, first_model)} in {first_where}; a model has one batcher, "
                    "so one setting"
                )
            if not step.stage:
                continue
            if step.model_name not in models:
                models[step.model_name] = (step.stage, plan.source, step.label)
            elif models[step.model_name][0] != step.stage:
                stage, file, label = models[step.model_name]
                errors.append(
                    f"{plan.source}: {step.label}: model '{step.model_name}' "
                    f"is served by stage '{step.stage}' here but by stage '{stage}' in {file} ({label}); "
                    "a model name must have one stage"
                )
    step_models = {step.model_name: (plan.source, step.label) for plan in plans for step in plan.steps}
    for plan in plans:
        if plan.name in step_models and step_models[plan.name][0] != plan.source:
            file, label = step_models[plan.name]
            errors.append(
                f"{plan.source}: ensemble name '{plan.name}' is also a stage model name ({file}, {label}); "
                f"the router serves ensembles and stage models in one namespace"
            )
    if errors:
        raise ConfigError("\n".join(errors))
    return Catalog(
        ensembles=types.MappingProxyType(ensembles),
        stages=types.MappingProxyType({key: endpoint for key, (endpoint, _) in endpoints.items()}),
    )

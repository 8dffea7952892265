"""The schema of an ensemble YAML file: pydantic models that type every value and reject unknown keys.

An ensemble file uses Triton's vocabulary: `inputs`, `outputs` and `steps`, each step calling a stage model
and mapping its tensors with `input_map` / `output_map` (stage tensor name: ensemble tensor name). Stage
endpoints are declared once under `stages` and referred to by key; their addresses may use `${VAR}` and
`${VAR:-default}`, expanded from the environment given in the validation context (`environ`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pipeline.ensemble.plan import COMPARISONS, Comparison
from pipeline.protocol.datatypes import DATATYPES
from pipeline.protocol.types import BatchingConfig

Name = Annotated[str, StringConstraints(strict=True, min_length=1)]

# `${VAR}` or `${VAR:-default}`; anything else starting with `${` is reported as malformed.
_ENV_REFERENCE = re.compile(r"\$\{([^}]*)\}?")
_ENV_BODY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+(?:%[\w.-]+)?\]|[A-Za-z0-9_.-]+):(\d{1,5})")
# gRPC target schemes that have no `host:port` form, passed through as they are; and `file:`, a file of
# replica addresses the router reads again and again (`pipeline.router.stages.targets`).
_GRPC_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:", "file:")


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorConfig(_Schema):
    """An ensemble input or output as written in YAML."""

    #: The tensor's name, as clients send it and as steps' `input_map` / `output_map` values name it.
    name: Name
    #: The protocol's datatype: `FP32`, `INT64`, `BYTES`, ... (not Triton's `TYPE_FP32`).
    datatype: Name
    #: Dimensions, the batch dimension first (-1 where a dimension varies).
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


#: The router's batching defaults: `BatchingConfig` is their one home, the schema only types and bounds them.
_BATCHING = BatchingConfig()


class DynamicBatchingConfig(_Schema):
    """Triton's `dynamic_batching` for a stage model, as written in YAML (see `pipeline.router.scheduling.batching`);
    each knob's meaning and default are `BatchingConfig`'s. A model's batching is the model's: its
    `config.pbtxt` declares it, and an ensemble may state it only for a model whose config sets none (every
    ensemble that calls the model then shares it; two that state it differently disagree)."""

    max_batch_size: PositiveInt = _BATCHING.max_batch_size
    max_queue_delay_microseconds: NonNegativeInt = _BATCHING.max_queue_delay_microseconds
    preferred_batch_size: tuple[PositiveInt, ...] = _BATCHING.preferred_batch_size
    max_queue_size: NonNegativeInt = _BATCHING.max_queue_size
    default_timeout_microseconds: NonNegativeInt = _BATCHING.default_timeout_microseconds
    allow_timeout_override: bool = _BATCHING.allow_timeout_override
    priority_levels: NonNegativeInt = _BATCHING.priority_levels
    default_priority_level: NonNegativeInt = _BATCHING.default_priority_level
    preserve_ordering: bool = _BATCHING.preserve_ordering
    max_inflight_batches: PositiveInt = _BATCHING.max_inflight_batches  # per ready replica of the stage
    idle_dispatch: bool = _BATCHING.idle_dispatch
    batch_upcoming: bool = _BATCHING.batch_upcoming

    @model_validator(mode="after")
    def _consistent(self) -> DynamicBatchingConfig:
        self.compile()  # BatchingConfig checks how the knobs fit together
        return self

    def compile(self) -> BatchingConfig:
        return BatchingConfig(**self.model_dump())


class StageConfig(_Schema):
    """A stage endpoint as written in YAML; `address` may use `${VAR}` and `${VAR:-default}`.

    `dynamic_batching` applies to every step of this file that calls the stage, unless the step sets its own
    (see `DynamicBatchingConfig`: only for models whose config sets none).
    """

    #: `host:port`, `[ipv6]:port`, `unix:path`, a gRPC target (`dns:///name:port`, ...) or `file:PATH`, a file
    #: of replica addresses the router reads again and again.
    address: Name
    #: Batching for the steps of this file that call the stage (only for models whose config sets none).
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

    #: The value equals this number or string.
    equals: Operand | None = None
    #: The value differs from this number or string.
    not_equals: Operand | None = None
    #: The value is greater than this number.
    greater_than: Number | None = None
    #: The value is greater than or equal to this number.
    greater_equal: Number | None = None
    #: The value is less than this number.
    less_than: Number | None = None
    #: The value is less than or equal to this number.
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

    #: The ensemble tensor (of one element) whose value the comparison reads.
    tensor: Name | None = None
    #: A switch declared under `switches`.
    switch: Name | None = None
    #: A case of that switch, or `default`.
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

    #: The case's name, which steps' `when: {switch, case}` give (not `default`).
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

    #: The ensemble tensor (of one element) whose value the cases compare.
    tensor: Name
    #: The cases, tried in order.
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

    #: Cache the ensemble's responses in the router.
    enable: bool = False


class StepConfig(_Schema):
    """An ensemble step as written in YAML."""

    #: The model the step calls.
    model_name: Name
    #: -1 = the stage's default version. A string is accepted too (OIP versions are strings on the wire),
    #: but only a numeric one: Triton's `ensemble_scheduling.step.model_version` is an int64.
    model_version: int | str = -1
    #: A key of `stages`; without it the router finds the stage that serves the model (`RepositoryIndex`).
    stage: Name | None = None
    #: The model's input name: the ensemble tensor it is given.
    input_map: dict[Name, Name]
    #: The model's output name: the ensemble tensor it becomes.
    output_map: dict[Name, Name]
    #: Overrides the stage's `dynamic_batching` for this step's model; `false` turns batching off. Only for
    #: a model whose config sets none, as every ensemble that calls the model shares one batcher.
    dynamic_batching: DynamicBatchingConfig | Literal[False] | None = None
    #: The step runs only for the requests that meet this condition (and have all its inputs).
    when: WhenConfig | None = None
    #: Fan-out: run the step once per element of these tensors' first dimension (ensemble tensors the
    #: step's `input_map` reads, all as long), each element a request of one item at the model's batcher,
    #: and gather its outputs back in order along the first dimension. 0 elements: empty outputs.
    for_each: tuple[Name, ...] = ()

    @field_validator("for_each", mode="before")
    @classmethod
    def _tensor_or_tensors(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

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
    #: The largest batch a request may carry (the first dimension of its inputs); 0: no batch dimension.
    max_batch_size: Annotated[int, Field(strict=True, ge=0)] = 64
    #: May be left out when no step names a stage (the router's own stages, `--stage`, serve them).
    stages: dict[Name, StageConfig] = Field(default_factory=dict)
    #: The tensors a request carries.
    inputs: tuple[TensorConfig, ...]
    #: The tensors a response carries.
    outputs: tuple[TensorConfig, ...]
    #: The steps; they run as their inputs become available, not in the order written.
    steps: tuple[StepConfig, ...]
    #: Switches that steps' `when` name, by name.
    switches: dict[Name, SwitchConfig] = Field(default_factory=dict)
    #: Cache whole responses of this ensemble in the router (its `--cache-size`).
    response_cache: ResponseCacheConfig = Field(default_factory=ResponseCacheConfig)
    #: Triton's `ensemble_scheduling { max_inflight_requests }`: responses of a decoupled step that each step
    #: after it holds at once, across all requests (0: no limit).
    max_inflight_requests: NonNegativeInt = 0


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

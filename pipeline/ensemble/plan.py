"""The compiled, immutable form of an ensemble: what the router's executor runs.

`pipeline.ensemble.compiler` turns validated ensembles into these; nothing here knows about YAML or pydantic,
so the executor never depends on the file schema. `ModelSignature` is a stage model's real interface, which
the router learns from `ModelMetadata` at start-up and `pipeline.ensemble.signatures` checks a plan against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pipeline.protocol.types import BatchingConfig, TensorSpec


@dataclass(frozen=True, slots=True)
class StageEndpoint:
    """A stage service the router calls: its key in the ensemble files and its gRPC target."""

    name: str
    #: `host:port`, `[ipv6]:port` or a target with a gRPC scheme (`unix:`, `dns:` ...), env already expanded.
    address: str
    #: Stage calls (`ModelInfer`, a batch counting as one) in flight at once; more wait for a slot within
    #: their deadline. 0: no limit. Triton's `max_inflight_requests`, per stage and for unbatched steps too.
    max_inflight_requests: int = 0


#: The comparisons a condition may make, each with its complement: what `when:` and a switch's cases say.
COMPARISONS = {
    "equals": "==",
    "not_equals": "!=",
    "greater_than": ">",
    "greater_equal": ">=",
    "less_than": "<",
    "less_equal": "<=",
}


@dataclass(frozen=True, slots=True)
class Comparison:
    """One comparison of a request's single value with a constant: `value <op> operand`.

    `op` is a key of `COMPARISONS`. Strings compare only for equality (a BYTES tensor's element, as UTF-8);
    numbers compare with every operator.
    """

    op: str
    operand: float | str

    def holds(self, value: float | str) -> bool:
        """Whether `value` (of the operand's kind) satisfies the comparison."""
        operand = self.operand
        if self.op == "equals":
            return value == operand
        if self.op == "not_equals":
            return value != operand
        assert isinstance(value, float | int) and isinstance(operand, float | int)
        if self.op == "greater_than":
            return value > operand
        if self.op == "greater_equal":
            return value >= operand
        if self.op == "less_than":
            return value < operand
        return value <= operand

    def __str__(self) -> str:
        return f"{COMPARISONS[self.op]} {self.operand!r}"


@dataclass(frozen=True, slots=True)
class Switch:
    """A switch on one tensor's single value: its cases are tried in order, the first that holds is taken,
    and `default` is taken when none does. The cases therefore exclude each other."""

    name: str
    tensor: str
    #: (case name, comparison), in the order they are tried.
    cases: tuple[tuple[str, Comparison], ...]

    def choose(self, value: float | str) -> str:
        """The case a value takes (`default` when no case holds)."""
        return next((case for case, comparison in self.cases if comparison.holds(value)), "default")


@dataclass(frozen=True, slots=True)
class Condition:
    """When a step runs: a comparison of one tensor's single value (`comparison`), or one case of a switch
    (`switch` and `case`). The tensor is read once per request; it must hold exactly one element."""

    tensor: str
    comparison: Comparison | None = None
    switch: Switch | None = None
    case: str = ""

    def holds(self, value: float | str) -> bool:
        """Whether the step runs for a request whose condition tensor holds `value`."""
        if self.switch is not None:
            return self.switch.choose(value) == self.case
        assert self.comparison is not None
        return self.comparison.holds(value)

    @property
    def operands(self) -> tuple[float | str, ...]:
        """Every constant the condition compares with (its switch's cases included)."""
        if self.switch is not None:
            return tuple(c.operand for _, c in self.switch.cases)
        assert self.comparison is not None
        return (self.comparison.operand,)

    def __str__(self) -> str:
        if self.switch is not None:
            return f"switch '{self.switch.name}' on '{self.tensor}' takes case '{self.case}'"
        return f"'{self.tensor}' {self.comparison}"


@dataclass(frozen=True, slots=True)
class PlanStep:
    """One step of an ensemble: a call of one stage model with tensors mapped in and out.

    `index` is the step's position in the YAML file (what error messages and logs show), not its position
    in `EnsemblePlan.steps`, which is topological.
    """

    index: int
    model_name: str
    #: "" means the stage's default version (YAML `model_version: -1` or absent).
    model_version: str
    #: Key of the `StageEndpoint` that serves `model_name`; "" where the ensemble names none (always in a
    #: `config.pbtxt` ensemble): the router then finds the stage whose `RepositoryIndex` lists the model.
    stage: str
    #: (stage tensor, ensemble tensor) pairs, in YAML order: what Triton calls `input_map`.
    inputs: tuple[tuple[str, str], ...]
    #: (stage tensor, ensemble tensor) pairs, in YAML order: what Triton calls `output_map`.
    outputs: tuple[tuple[str, str], ...]
    #: YAML indices of the steps whose outputs this step consumes, sorted and unique; empty when the step
    #: reads ensemble inputs only.
    depends_on: tuple[int, ...]
    #: How the router batches calls of this model, as the ensemble sets it (None: the ensemble sets none).
    batching: BatchingConfig | None = None
    #: Where `batching` is None: whether the stage model's own `dynamic_batching` (from its `ModelConfig`)
    #: applies. False where the ensemble turned batching off (`dynamic_batching: false`).
    model_batching: bool = True
    #: When the step runs (None: whenever its inputs exist). Its tensor counts as one of the step's inputs:
    #: a request that lacks it skips the step.
    when: Condition | None = None
    #: A fan-out step's ensemble tensors, split along their first dimension: the step runs once per element
    #: (each a request of one item), its outputs gathered back in order. Empty for an ordinary step.
    for_each: tuple[str, ...] = ()

    @property
    def consumed(self) -> tuple[str, ...]:
        """Every ensemble tensor the step needs: its inputs, and its condition's tensor."""
        tensors = tuple(tensor for _, tensor in self.inputs)
        if self.when is not None and self.when.tensor not in tensors:
            tensors += (self.when.tensor,)
        return tensors

    @property
    def label(self) -> str:
        """How messages name the step: `step N (model_name)`, N being the YAML position."""
        return f"step {self.index} ({self.model_name})"


@dataclass(frozen=True, slots=True)
class EnsemblePlan:
    """A validated ensemble, ready to execute.

    `steps` is in a topological order (every step comes after all the steps it depends on; ties keep the
    YAML order), so running them in sequence is always valid, and a step may start as soon as every step
    in its `depends_on` has finished. Look steps up by `PlanStep.index`, not by position in `steps`.
    """

    name: str
    #: The ensemble file's path as it was given to the loader.
    source: str
    #: 0 means the ensemble does not batch and its shapes have no batch dimension.
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    steps: tuple[PlanStep, ...]
    #: Every stage the file declares, by key (read-only).
    stages: Mapping[str, StageEndpoint]
    #: Outputs a request may lack (declared `optional: true`): no step produces them on some path.
    optional_outputs: frozenset[str] = frozenset()
    #: Triton's `response_cache { enable: true }` for the whole ensemble: a request that matches an earlier
    #: one gets its response without any step running.
    response_cache: bool = False
    #: Triton's `ensemble_scheduling { max_inflight_requests }`: the responses of a decoupled step that the
    #: steps after it hold at once, across all the ensemble's requests, until the client has taken them (0: no
    #: limit). A decoupled step reads its next response only when there is room.
    max_inflight_requests: int = 0

    #: Whether some request may skip a step (a step has a condition). Derived from `steps`.
    conditional: bool = field(init=False)
    #: Whether the steps form one chain, each consuming only the one before it (and the ensemble's inputs),
    #: none of them conditional: they then run one after another in the request's own task. Derived.
    linear: bool = field(init=False)

    def __post_init__(self) -> None:
        conditional = any(step.when is not None for step in self.steps)
        chained = all(
            step.depends_on == ((self.steps[i - 1].index,) if i else ()) for i, step in enumerate(self.steps)
        )
        object.__setattr__(self, "conditional", conditional)
        object.__setattr__(self, "linear", chained and not conditional)


@dataclass(frozen=True, slots=True)
class Catalog:
    """Every ensemble the router serves and every stage endpoint it knows (both read-only): those given
    to the router (`--stage`) first, then those the ensemble files declare, in the order declared."""

    ensembles: Mapping[str, EnsemblePlan]
    stages: Mapping[str, StageEndpoint]
    #: The ensembles that failed to load (a file that cannot be read or compiled, or that disagrees with
    #: another), each with the reason: served as UNAVAILABLE where the router does not exit on errors.
    failed: Mapping[str, str] = field(default_factory=dict)
    #: The model repository whose ensembles these are ("" for none): where messages find a model's config.
    repository: str = ""

    def stage_models(self) -> dict[str, str]:
        """Stage model name -> key of the stage that serves it, across all ensembles, for the steps that name
        a stage.

        The loader rejects a model name used with two different stage keys, so this is well defined.
        """
        return {
            step.model_name: step.stage
            for plan in self.ensembles.values()
            for step in plan.steps
            if step.stage
        }


@dataclass(frozen=True, slots=True)
class ModelSignature:
    """A stage model's interface as its `ModelMetadata` reports it (shapes include the batch dimension)."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    #: From `ModelConfig`; 0 means the model does not batch.
    max_batch_size: int
    #: The model's own `dynamic_batching` from its `ModelConfig` (None where it sets none): how the router
    #: batches its calls where no ensemble says otherwise.
    batching: BatchingConfig | None = None
    #: The versions `ModelMetadata` lists; the last is the one a request naming none gets.
    versions: tuple[str, ...] = ()
    #: Triton's `response_cache { enable: true }` in its `ModelConfig`: the router caches its responses.
    response_cache: bool = False
    #: False where the model says its answers may differ for the same request (`ModelConfig.parameters`
    #: `deterministic: "false"`): such a model's responses are never cached.
    deterministic: bool = True
    #: Its `model_transaction_policy { decoupled: true }`: it answers a request with any number of responses.
    decoupled: bool = False
    #: Its `sequence_batching`: a stateful model, whose requests the stage that keeps their state batches.
    sequence: bool = False

    @property
    def declared(self) -> bool:
        """Whether the model's `ModelMetadata` lists its tensors. The protocol does not require it: a server
        may leave them out (the signature is then learnt from the model's first response)."""
        return bool(self.inputs or self.outputs)

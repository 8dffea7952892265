"""The conditions of an ensemble's steps, compiled: each step's `when` with the switch it names looked up,
and every path a request can take through them checked (no tensor produced twice on one path, every output
that is not optional produced on each). Part of `pipeline.ensemble.compiler`, which reports the errors.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping

from pipeline.ensemble.plan import Condition, Switch
from pipeline.ensemble.schema import EnsembleConfig
from pipeline.protocol.types import TensorSpec

log = logging.getLogger(__name__)

#: The most paths through the conditions the compiler checks one by one.
_MAX_PATHS = 4096


class ConditionCompiler:
    """The conditions of one validated ensemble's steps; each error found goes to `fail`."""

    def __init__(
        self, config: EnsembleConfig, source: str, labels: list[str], fail: Callable[[str], None]
    ) -> None:
        """`labels`: how messages name each step; `fail` collects an error (the compiler's)."""
        self.config = config
        self.source = source
        self.labels = labels
        self.fail = fail

    def conditions(self) -> list[Condition | None]:
        """Each step's condition (None: it has none, or an error), by YAML index; a switch no step uses is
        logged."""
        conditions = [self._condition(i) for i in range(len(self.config.steps))]
        used = {c.switch.name for c in conditions if c and c.switch}
        for name in self.config.switches.keys() - used:
            log.warning("%s: switch '%s' is not used by any step", self.source, name)
        return conditions

    def _condition(self, index: int) -> Condition | None:
        """A step's `when`, with the switch it names looked up."""
        label = self.labels[index]
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

    def check_paths(
        self,
        order: list[int],
        conditions: list[Condition | None],
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
        samples = self._samples(conditions)
        if samples is None:
            return
        reported: set[tuple[str, ...]] = set()
        tensors = list(samples)
        for values in itertools.product(*(samples[t] for t in tensors)):
            world = dict(zip(tensors, values, strict=True))
            exists, ran = self._follow(world, order, conditions, set(inputs), reported)
            for tensor in outputs:
                if tensor not in exists and tensor not in optional and (tensor,) not in reported:
                    reported.add((tensor,))
                    path = _path_words(world, ran, self.labels)
                    self.fail(
                        f"ensemble output '{tensor}': no step produces it {path}; "
                        "produce it on every path, or declare it 'optional: true'"
                    )

    def _samples(self, conditions: list[Condition | None]) -> dict[str, list[float | str]] | None:
        """The values each condition tensor takes on the paths (see `_samples`); None, the error reported,
        where a tensor is compared with strings and numbers both, or the paths are too many to check."""
        operands: dict[str, set[float | str]] = {}
        for i, condition in enumerate(conditions):
            if condition is None:
                continue
            kinds = operands.setdefault(condition.tensor, set())
            kinds.update(condition.operands)
            if len({isinstance(v, str) for v in kinds}) > 1:
                self.fail(
                    f"{self.labels[i]}: conditions on tensor '{condition.tensor}' compare it with strings "
                    "and with numbers; a tensor holds one or the other"
                )
                return None
        samples = {tensor: _samples(values) for tensor, values in operands.items()}
        paths = math.prod(len(values) for values in samples.values())
        if paths > _MAX_PATHS:
            self.fail(
                f"the conditions make {paths} paths to check (more than {_MAX_PATHS}); use fewer condition "
                "tensors or fewer distinct constants"
            )
            return None
        return samples

    def _follow(
        self,
        world: Mapping[str, float | str],
        order: list[int],
        conditions: list[Condition | None],
        exists: set[str],
        reported: set[tuple[str, ...]],
    ) -> tuple[set[str], list[int]]:
        """Run the steps in `order` for a request whose condition tensors hold `world`, from the tensors that
        `exists` names: the tensors that then exist and the steps that ran. A tensor two steps produce on
        this path is reported (once, with those producers, among the errors `reported`)."""
        labels = self.labels
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
        return exists, ran


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

"""The graph of a validated ensemble, checked and compiled into an `EnsemblePlan`.

One producer per tensor (or several whose conditions exclude each other), everything consumed is produced,
no cycle, and every output that is not optional produced on every path a request can take through the
conditions (`pipeline.ensemble.conditions` compiles the conditions and follows those paths). Every error
found is reported at once, naming the file, the step and the tensor.
"""

from __future__ import annotations

import difflib
import heapq
import itertools
import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.ensemble.conditions import ConditionCompiler
from pipeline.ensemble.loader import validate_ensemble
from pipeline.ensemble.plan import Condition, EnsemblePlan, PlanStep, StageEndpoint
from pipeline.ensemble.schema import EnsembleConfig, TensorConfig
from pipeline.protocol.errors import ConfigError
from pipeline.protocol.types import BatchingConfig, TensorSpec

log = logging.getLogger(__name__)


def compile_ensemble(
    data: Any, source: str, *, default_name: str | None = None, environ: Mapping[str, str] | None = None
) -> EnsemblePlan:
    """Validate an ensemble already parsed from YAML (a mapping) and compile it into a plan.

    `source` names the origin in messages; `default_name` is the name when the data has none (the file's
    stem for `load_ensemble`). `environ` (default `os.environ`) expands `${VAR}` in stage addresses.
    """
    config = validate_ensemble(data, source, environ=environ)
    name = config.name or default_name
    if not name:
        raise ConfigError(f"{source}: missing required key 'name' (there is no file name to default to)")
    return _Compiler(config, name, source).compile()


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
        #: How messages name each step: `step N (model_name)`, N being the YAML position.
        self.labels = [f"step {i} ({step.model_name})" for i, step in enumerate(config.steps)]
        self.condition_compiler = ConditionCompiler(config, source, self.labels, self.fail)

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
        """The plan, or `ConfigError` listing every error of the graph: the declarations, the producers and
        consumers of each tensor, the order of the steps, then (with conditions) every path through them."""
        inputs, outputs = self._ensemble_tensors()
        conditions = self.condition_compiler.conditions()
        conditional = any(condition is not None for condition in conditions)
        producers = self._producers(inputs, conditional)
        depends_on, consumed = self._dependencies(producers, conditions)
        self._check_outputs_produced(inputs, outputs, producers)
        self._raise_errors()
        order = self._topological_order(depends_on)
        self._raise_errors()
        optional = frozenset(t.name for t in self.config.outputs if t.optional)
        if conditional:
            self.condition_compiler.check_paths(order, conditions, inputs, outputs, optional)
            self._raise_errors()
        self._log_unused(inputs, outputs, producers, consumed)
        return self._plan(order, depends_on, conditions, inputs, outputs, optional)

    def _raise_errors(self) -> None:
        if self.errors:
            raise ConfigError("\n".join(self.errors))

    def _ensemble_tensors(self) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
        """The ensemble's inputs and outputs by name, checked as declarations; and that there are steps."""
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
        for tensor in inputs:
            if any(t.name == tensor and t.optional for t in config.inputs):
                self.fail(f"ensemble input '{tensor}': 'optional' applies to outputs only")
        return inputs, outputs

    def _producers(self, inputs: Mapping[str, TensorSpec], conditional: bool) -> dict[str, list[_Producer]]:
        """Each tensor's producers: the ensemble input, or the steps whose output_map names it. Several steps
        may produce one tensor only in an ensemble with conditions (`ConditionCompiler.check_paths` then
        checks that they exclude each other)."""
        producers: dict[str, list[_Producer]] = {tensor: [_Producer(None, tensor)] for tensor in inputs}
        for i, step in enumerate(self.config.steps):
            self._check_step(i)
            label = self.labels[i]
            for stage_tensor, tensor in step.output_map.items():
                previous = producers.get(tensor)
                if previous is None:
                    producers[tensor] = [_Producer(i, stage_tensor)]
                elif previous[0].step is None:
                    self.fail(
                        f"{label}: output '{stage_tensor}' → tensor '{tensor}': "
                        f"'{tensor}' is an ensemble input, and a tensor can have only one producer"
                    )
                elif not conditional or previous[-1].step == i:
                    last = previous[-1]
                    assert last.step is not None
                    self.fail(
                        f"{label}: output '{stage_tensor}' → tensor '{tensor}': '{tensor}' is already "
                        f"produced by {self.labels[last.step]} output '{last.stage_tensor}'; "
                        f"a tensor can have only one producer"
                        + ("" if last.step == i else " (unless the producers' conditions exclude each other)")
                    )
                else:
                    # Checked by `ConditionCompiler.check_paths`: the producers must never run for the same request.
                    previous.append(_Producer(i, stage_tensor))
        return producers

    def _check_step(self, index: int) -> None:
        """What a step says of itself: a declared stage, a model that is not the ensemble, tensors mapped."""
        step, label = self.config.steps[index], self.labels[index]
        if step.stage is not None and step.stage not in self.config.stages:
            declared = ", ".join(sorted(self.config.stages)) or "none"
            self.fail(f"{label}: stage '{step.stage}' is not declared under 'stages' (declared: {declared})")
        if step.model_name == self.name:
            self.fail(
                f"{label}: model_name '{step.model_name}' is the ensemble's own name; the router "
                f"serves ensembles and stage models in one namespace"
            )
        if not step.input_map:
            self.fail(f"{label}: input_map is empty; map at least one stage input to an ensemble tensor")
        if not step.output_map:
            self.fail(f"{label}: output_map is empty; map at least one stage output to an ensemble tensor")
        read = set(step.input_map.values())
        for tensor in step.for_each:
            if tensor not in read:
                self.fail(
                    f"{label}: for_each names tensor '{tensor}', which its input_map does not read (it reads "
                    f"{', '.join(sorted(read)) or 'none'}); the elements of a tensor the step reads are what "
                    "it runs on"
                )
        if len(set(step.for_each)) != len(step.for_each):
            self.fail(f"{label}: for_each names a tensor more than once")

    def _dependencies(
        self, producers: Mapping[str, list[_Producer]], conditions: list[Condition | None]
    ) -> tuple[list[tuple[int, ...]], set[str]]:
        """The steps each step depends on (by YAML index, sorted), and every tensor some step consumes; a
        tensor that nothing produces is an error."""
        depends_on: list[tuple[int, ...]] = []
        consumed: set[str] = set()
        for i, step in enumerate(self.config.steps):
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
                        f"{self.labels[i]}: {what} tensor '{tensor}': "
                        f"nothing produces '{tensor}' (it is neither an ensemble input nor any step's output)"
                        f"{hint}"
                    )
                    continue
                deps.update(producer.step for producer in found if producer.step is not None)
            depends_on.append(tuple(sorted(deps)))
        return depends_on, consumed

    def _check_outputs_produced(
        self,
        inputs: Mapping[str, TensorSpec],
        outputs: Mapping[str, TensorSpec],
        producers: Mapping[str, list[_Producer]],
    ) -> None:
        for tensor in outputs:
            if tensor in inputs or tensor in producers:
                continue
            close = difflib.get_close_matches(
                tensor, [t for t, p in producers.items() if p[0].step is not None], n=1
            )
            hint = f"; did you mean '{close[0]}'?" if close else ""
            self.fail(
                f"ensemble output '{tensor}': no step produces it (no output_map maps to '{tensor}'){hint}"
            )

    def _log_unused(
        self,
        inputs: Mapping[str, TensorSpec],
        outputs: Mapping[str, TensorSpec],
        producers: Mapping[str, list[_Producer]],
        consumed: set[str],
    ) -> None:
        for tensor in inputs.keys() - consumed - outputs.keys():
            log.warning("%s: ensemble input '%s' is not used by any step", self.source, tensor)
        for tensor, found in producers.items():
            for source in found:
                if source.step is not None and tensor not in consumed and tensor not in outputs:
                    log.info(
                        "%s: %s output '%s' → tensor '%s' is not used",
                        self.source,
                        self.labels[source.step],
                        source.stage_tensor,
                        tensor,
                    )

    def _plan(
        self,
        order: list[int],
        depends_on: list[tuple[int, ...]],
        conditions: list[Condition | None],
        inputs: Mapping[str, TensorSpec],
        outputs: Mapping[str, TensorSpec],
        optional: frozenset[str],
    ) -> EnsemblePlan:
        config = self.config
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
                for_each=config.steps[i].for_each,
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
            max_inflight_requests=config.max_inflight_requests,
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

    def _topological_order(self, depends_on: list[tuple[int, ...]]) -> list[int]:
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
            self.fail(self._describe_cycle(set(range(len(depends_on))) - set(order), depends_on))
        return order

    def _describe_cycle(self, remaining: set[int], depends_on: list[tuple[int, ...]]) -> str:
        labels = self.labels
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


def _version(value: int | str) -> str:
    return "" if value == -1 else str(value)

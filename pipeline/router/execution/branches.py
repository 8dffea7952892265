"""The branches of an ensemble with conditions: whether a request takes a step (`skip_reason`), counted per
step and outcome (`pipeline_branch_requests_total`), and a skipped step traced with its reason. The DAG
executor (`pipeline.router.execution.executor`) asks before it runs each step of such an ensemble.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.ensemble.plan import EnsemblePlan, PlanStep
from pipeline.protocol.codec import Tensor
from pipeline.protocol.datatypes import element_count
from pipeline.protocol.errors import InvalidInput
from pipeline.router.scheduling.dispatch import Announcement
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.telemetry import SKIP_REASON, STEP_SKIPPED, Telemetry


class Branches:
    """Whether each request takes each step of an ensemble with conditions, counted and traced."""

    def __init__(self, telemetry: Telemetry, metrics: Metrics) -> None:
        self.telemetry = telemetry
        self.metrics = metrics
        self._counters: dict[tuple[str, int, bool], Any] = {}

    def skipped(
        self,
        plan: EnsemblePlan,
        step: PlanStep,
        values: Mapping[str, Tensor],
        attributes: dict[str, Any],
        announced: Announcement,
    ) -> bool:
        """Whether a step of an ensemble with conditions is skipped for this request: counted either way,
        and a skipped one traced with its reason (its span gets `attributes`) and taken back from its
        batcher's expected requests (`announced`)."""
        skipped = skip_reason(plan, step, values)
        self._counter(plan.name, step, not skipped).inc()
        if not skipped:
            return False
        if self.telemetry.enabled:
            with self.telemetry.span(
                f"step {step.model_name}", {**attributes, STEP_SKIPPED: True, SKIP_REASON: skipped}
            ):
                pass
        announced.withdraw(step.index)  # it will not come: its batch need not wait for it
        return True

    def _counter(self, ensemble: str, step: PlanStep, taken: bool) -> Any:
        """The `pipeline_branch_requests_total` child of a step and outcome, looked up once."""
        key = (ensemble, step.index, taken)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self.metrics.branch_requests.labels(
                ensemble, f"{step.index}:{step.model_name}", "true" if taken else "false"
            )
        return counter


def skip_reason(plan: EnsemblePlan, step: PlanStep, values: Mapping[str, Tensor]) -> str:
    """Why a request skips a step ("" when it runs): an input that no step produced for it, or a condition
    that does not hold. A condition tensor holding other than one element is refused."""
    missing = [tensor for tensor in step.consumed if tensor not in values]
    if missing:
        return f"no tensor {', '.join(repr(t) for t in missing)} (its producer was skipped)"
    when = step.when
    if when is None:
        return ""
    value = condition_value(values[when.tensor], f"ensemble '{plan.name}' {step.label}")
    if when.holds(value):
        return ""
    return f"condition not met: {when} (value {value!r})"


def condition_value(tensor: Tensor, where: str) -> float | str:
    """The single value a condition reads: a number, or a BYTES element as text. A tensor holding any other
    number of elements (a request of several items, say) is refused: a condition reads one per request."""
    if element_count(tensor.shape) != 1:
        raise InvalidInput(
            f"{where}: condition tensor '{tensor.name}' holds {element_count(tensor.shape)} elements "
            f"(shape {list(tensor.shape)}); a condition reads exactly one value per request, so send one "
            "item per request to this ensemble"
        )
    value = tensor.to_array().reshape(-1)[0]
    if tensor.datatype == "BYTES":
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(f"{where}: condition tensor '{tensor.name}' is not UTF-8 text") from None
    return float(value)

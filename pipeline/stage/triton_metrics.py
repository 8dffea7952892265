"""Triton's custom metrics API of `triton_python_backend_utils` (re-exported there): `MetricFamily`, its
`Metric`s and `MetricKind`, as a model written for Triton's Python backend uses them:

    family = pb_utils.MetricFamily(name="requests_process_latency_ns", description="...",
                                   kind=pb_utils.MetricFamily.COUNTER)   # or GAUGE, HISTOGRAM
    metric = family.Metric(labels={"model": "m", "version": "1"})     # buckets=[...] for a HISTOGRAM
    metric.increment(42.0); metric.value()                             # set(v): GAUGE; observe(v): HISTOGRAM

The families are the process's (`pipeline.runtime.model_metrics.MODEL_FAMILIES`): the stage service that runs
the model shows them on its `/metrics`, and the router on its own, beside Triton's and ours. As in Triton, a
name that exists gives that family (with its first description), the same labels give the same series, and a
family or series lasts as long as a `MetricFamily` or `Metric` object that made it: keep them (on the model
object, as Triton's examples do). A `Metric` keeps its family. What Triton refuses is refused with a
`TritonModelException` saying why (a negative increment of a COUNTER, `set` on a COUNTER, `observe` on
anything but a HISTOGRAM, `value` of a HISTOGRAM, labels that are not a dict of strings, a HISTOGRAM without
buckets or a COUNTER or GAUGE with them, buckets that are not strictly increasing); so is what Triton 2.51
cannot survive (a name that is not a Prometheus metric name, or that exists as another kind).
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Mapping, Sequence
from enum import IntEnum
from typing import Any, ClassVar

from pipeline.runtime.model_metrics import COUNTER, GAUGE, HISTOGRAM, MODEL_FAMILIES, Series
from pipeline.stage.triton_errors import TritonModelException


class MetricKind(IntEnum):
    """The kinds of a `MetricFamily` (also `MetricFamily.COUNTER`, ...)."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


_KINDS = {MetricKind.COUNTER: COUNTER, MetricKind.GAUGE: GAUGE, MetricKind.HISTOGRAM: HISTOGRAM}


class Metric:
    """One series of a `MetricFamily`, made by `MetricFamily.Metric(labels, buckets)`."""

    def __init__(self, family: MetricFamily, series: Series) -> None:
        self._family = family  # a family lasts while its metrics do
        self._series = series
        weakref.finalize(self, series.release)

    def increment(self, value: float) -> None:
        """Add `value` (a COUNTER's must not be negative; a GAUGE's may)."""
        self._apply("increment", value)

    def set(self, value: float) -> None:
        """Set a GAUGE to `value`."""
        self._apply("set", value)

    def observe(self, value: float) -> None:
        """Count `value` in a HISTOGRAM's buckets and sum."""
        self._apply("observe", value)

    def value(self) -> float:
        """The value of a COUNTER or GAUGE."""
        try:
            return self._series.value()
        except ValueError as err:
            raise TritonModelException(f"Failed to get metric value: {err}") from None

    def _apply(self, operation: str, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{operation}(): the value must be a number, not {type(value).__name__}")
        try:
            getattr(self._series, operation)(float(value))
        except ValueError as err:
            raise TritonModelException(f"Failed to {operation} metric value: {err}") from None


class MetricFamily:
    """A named metric family of one kind, made by a model (see the module docstring)."""

    COUNTER: ClassVar[MetricKind] = MetricKind.COUNTER
    GAUGE: ClassVar[MetricKind] = MetricKind.GAUGE
    HISTOGRAM: ClassVar[MetricKind] = MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: MetricKind) -> None:
        try:
            kind = MetricKind(kind)
        except ValueError:
            raise TritonModelException(
                f"Error when creating MetricFamily '{name}': kind {kind!r} is not MetricFamily.COUNTER, "
                "GAUGE or HISTOGRAM"
            ) from None
        try:
            family = MODEL_FAMILIES.acquire(name, description, _KINDS[kind])
        except ValueError as err:
            raise TritonModelException(f"Error when creating MetricFamily: {err}") from None
        self._family = family
        weakref.finalize(self, MODEL_FAMILIES.release, family)

    def Metric(
        self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> Metric:
        """The family's series of `labels` (none: no labels); a HISTOGRAM's needs `buckets`, its upper
        bounds in increasing order."""
        if labels is not None and not isinstance(labels, Mapping):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        if buckets is not None and not isinstance(buckets, list | tuple):
            raise TritonModelException("Failed to create metric. Buckets must be a list.")
        try:
            series = self._family.series_of(labels or {}, None if buckets is None else _numbers(buckets))
        except ValueError as err:
            raise TritonModelException(f"Failed to create metric: {err}") from None
        return Metric(self, series)


def _numbers(buckets: Sequence[Any]) -> list[float]:
    if not all(isinstance(b, numbers.Real) and not isinstance(b, bool) for b in buckets):
        raise TritonModelException(f"Failed to create metric. Buckets must be numbers: {list(buckets)!r}")
    return [float(b) for b in buckets]

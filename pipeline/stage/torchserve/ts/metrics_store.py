"""The metrics a handler records through `context.metrics` (`add_time`, `add_counter`, `add_metric`, ...):
kept per model, in memory, so handlers that record them run unchanged (they are not exported)."""

from __future__ import annotations

from typing import Any


class Metric:
    """One metric: its name, unit and value, updated as TorchServe's are."""

    def __init__(self, name: str, unit: str = "", metric_type: str = "COUNTER") -> None:
        self.name, self.unit, self.metric_type = name, unit, metric_type
        self.value: float = 0.0

    def add_or_update(self, value: float, dimension_values: Any = None, request_id: Any = None) -> None:
        self.value = self.value + value if self.metric_type == "COUNTER" else value

    def update(self, value: float) -> None:
        self.add_or_update(value)


class MetricsStore:
    """`context.metrics`: the handler's metrics by name."""

    def __init__(self) -> None:
        self.metrics: dict[str, Metric] = {}
        self.request_ids: Any = None

    def _metric(self, name: str, unit: str, metric_type: str) -> Metric:
        return self.metrics.setdefault(name, Metric(name, unit, metric_type))

    def add_metric(self, name: str, value: float = 0, unit: str = "", *args: Any, **kwargs: Any) -> Metric:
        metric = self._metric(name, unit, str(kwargs.get("metric_type", "COUNTER")))
        metric.add_or_update(value)
        return metric

    def add_counter(self, name: str, value: float, *args: Any, **kwargs: Any) -> None:
        self._metric(name, "count", "COUNTER").add_or_update(value)

    def add_time(self, name: str, value: float, *args: Any, unit: str = "ms", **kwargs: Any) -> None:
        self._metric(name, unit, "GAUGE").add_or_update(value)

    def add_size(self, name: str, value: float, *args: Any, unit: str = "MB", **kwargs: Any) -> None:
        self._metric(name, unit, "GAUGE").add_or_update(value)

    def add_percent(self, name: str, value: float, *args: Any, **kwargs: Any) -> None:
        self._metric(name, "percent", "GAUGE").add_or_update(value)

    def add_metric_to_cache(self, metric_name: str, unit: str = "", *args: Any, **kwargs: Any) -> Metric:
        return self._metric(metric_name, unit, str(kwargs.get("metric_type", "COUNTER")))

    def get_metric(self, metric_name: str, *args: Any) -> Metric:
        return self.metrics[metric_name]

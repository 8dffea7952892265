"""Metric families that models define (Triton's custom metrics, `pb_utils.MetricFamily`), exposed on
`/metrics` beside the server's own as Triton exposes them.

A process keeps one set of them, `MODEL_FAMILIES`, as Triton keeps one per server: a family is known by its
name, and whoever asks for a name that exists gets that family (its first description stays; another kind is
refused), and a series by its labels, so the instances of a model that each make the same family and labels
add to one value. A family lasts while something holds it (`acquire`/`release`: the models' `MetricFamily`
objects), a series while something holds it (`ModelFamily.series_of`/`Series.release`), as in Triton, where they go with the
Python objects that made them.

A stage service serves its process's families on `/metrics` and, for the router, as JSON on the gRPC method
`FAMILIES_METHOD` (`families_handler`): the router asks each replica of each stage when it is scraped, adds up
the series of equal labels (`merge`) and writes them on its own `/metrics` (`exposition`). The text is
Triton's: `# HELP` and `# TYPE` lines, labels sorted by name, a histogram's `_count`, `_sum`, then its
cumulative `_bucket`s, and numbers as Triton's prometheus-cpp writes them (`5.5`, `17`, `100000`, `Nan`).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import re
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any

import grpc

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
KINDS = (COUNTER, GAUGE, HISTOGRAM)
#: The gRPC method (request: empty; response: the families as JSON) a stage service answers for the router.
FAMILIES_SERVICE, FAMILIES_RPC = "pipeline.ModelMetrics", "Families"
FAMILIES_METHOD = f"/{FAMILIES_SERVICE}/{FAMILIES_RPC}"

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

#: A series' labels, sorted by name (as Triton writes them).
Labels = tuple[tuple[str, str], ...]
#: A family as plain data (what the gRPC method carries): name, description, kind and series, each series
#: {"labels": {...}, "value": v} or, for a histogram, {"labels", "buckets" (bounds), "counts" (per bucket, the
#: last +Inf's), "sum"}.
Snapshot = dict[str, Any]


class Series:
    """One labelled value of a family: a counter's or gauge's number, or a histogram's bucket counts and
    sum. Models update it from their own threads: every operation holds the family's lock."""

    def __init__(self, family: ModelFamily, labels: Labels, buckets: Sequence[float] | None) -> None:
        self.family = family
        self.labels = labels
        self.current = 0.0
        self.bounds = tuple(buckets or ())
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.holders = 0

    def increment(self, value: float) -> None:
        kind = self.family.kind
        if kind == HISTOGRAM:
            raise ValueError("a HISTOGRAM does not support increment (observe its values)")
        if kind == COUNTER and value < 0:
            raise ValueError(f"a COUNTER can only be incremented by non-negative values, not {value}")
        with self.family.lock:
            self.current += value

    def set(self, value: float) -> None:
        if self.family.kind != GAUGE:
            raise ValueError(f"a {self.family.kind.upper()} does not support set (only a GAUGE does)")
        with self.family.lock:
            self.current = value

    def observe(self, value: float) -> None:
        if self.family.kind != HISTOGRAM:
            raise ValueError(f"a {self.family.kind.upper()} does not support observe (only a HISTOGRAM does)")
        with self.family.lock:
            # A bucket's bound is inclusive (`le`): the first bound not below the value.
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.sum += value

    def value(self) -> float:
        if self.family.kind == HISTOGRAM:
            raise ValueError("a HISTOGRAM does not support value")
        return self.current

    def release(self) -> None:
        """One holder fewer: the last takes the series off its family."""
        family = self.family
        with family.lock:
            self.holders -= 1
            if self.holders <= 0 and family.series.get(self.labels) is self:
                del family.series[self.labels]

    def snapshot(self) -> dict[str, Any]:
        labels = dict(self.labels)
        if self.family.kind == HISTOGRAM:
            return {
                "labels": labels,
                "buckets": list(self.bounds),
                "counts": list(self.counts),
                "sum": self.sum,
            }
        return {"labels": labels, "value": self.current}


class ModelFamily:
    """A metric family of models: its name, description, kind and series by labels."""

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.series: dict[Labels, Series] = {}
        self.lock = threading.Lock()
        self.holders = 0

    def series_of(self, labels: Mapping[Any, Any], buckets: Sequence[float] | None) -> Series:
        """The series of `labels`, made (with `buckets`, a histogram's bounds) if it has none yet, and held
        once more. An existing histogram series keeps its bounds, as Triton's does."""
        for key, value in labels.items():
            if not isinstance(key, str) or not _LABEL_NAME.match(key) or key.startswith("__"):
                raise ValueError(f"invalid label name {key!r}: [a-zA-Z_][a-zA-Z0-9_]*, not starting with __")
            if not isinstance(value, str):
                raise ValueError(
                    f"label {key!r} has the value {value!r}, a {type(value).__name__}: not a string"
                )
        if (self.kind == HISTOGRAM) != (buckets is not None):
            raise ValueError("missing required buckets" if buckets is None else "unexpected buckets found")
        bounds = [float(b) for b in buckets or ()]
        if any(b >= c for b, c in itertools.pairwise(bounds)):
            raise ValueError(f"bucket boundaries must be strictly sorted: {bounds}")
        labelled = _key(labels)
        with self.lock:
            series = self.series.get(labelled)
            if series is None:
                series = self.series[labelled] = Series(self, labelled, bounds)
            series.holders += 1
        return series

    def snapshot(self) -> Snapshot:
        with self.lock:
            series = [s.snapshot() for s in self.series.values()]
        return {"name": self.name, "description": self.description, "kind": self.kind, "series": series}


class ModelFamilies:
    """The model metric families of a process, by name (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, ModelFamily] = {}

    def acquire(self, name: str, description: str, kind: str) -> ModelFamily:
        """The family called `name`, made if there is none, and held once more; `ValueError` for an invalid
        name or kind, or a name that exists as another kind."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}: {', '.join(KINDS)}")
        if not _METRIC_NAME.match(str(name)):
            raise ValueError(f"invalid metric name {name!r}: [a-zA-Z_:][a-zA-Z0-9_:]*")
        with self._lock:
            family = self._families.get(name)
            if family is None:
                family = self._families[name] = ModelFamily(name, str(description), kind)
            elif family.kind != kind:
                raise ValueError(f"a family named {name!r} exists as a {family.kind}, not a {kind}")
            family.holders += 1
        return family

    def release(self, family: ModelFamily) -> None:
        """One holder fewer: the last takes the family (and its series) off `/metrics`."""
        with self._lock:
            family.holders -= 1
            if family.holders <= 0 and self._families.get(family.name) is family:
                del self._families[family.name]

    def snapshot(self) -> list[Snapshot]:
        """Every family as plain data, in the order they were made."""
        with self._lock:
            families = list(self._families.values())
        return [family.snapshot() for family in families]


#: This process's model metric families.
MODEL_FAMILIES = ModelFamilies()


def merge(snapshots: Iterable[Snapshot]) -> list[Snapshot]:
    """Families of several servers as one: the series of equal labels added up (a histogram's where its
    bounds are equal; else the first stays), families in the order first seen; of families of one name, the
    first's description and kind (a family of another kind under that name is left out)."""
    merged: dict[str, Snapshot] = {}
    for family in snapshots:
        into = merged.get(family["name"])
        if into is None:
            merged[family["name"]] = {**family, "series": [dict(s) for s in family["series"]]}
            continue
        if into["kind"] != family["kind"]:
            continue
        by_labels = {_key(s["labels"]): s for s in into["series"]}
        for series in family["series"]:
            mine = by_labels.get(_key(series["labels"]))
            if mine is None:
                into["series"].append(by_labels.setdefault(_key(series["labels"]), dict(series)))
            elif "value" in series:
                mine["value"] += series["value"]
            elif mine["buckets"] == series["buckets"]:
                mine["counts"] = [a + b for a, b in zip(mine["counts"], series["counts"], strict=True)]
                mine["sum"] += series["sum"]
    return list(merged.values())


def _key(labels: Mapping[str, str]) -> Labels:
    return tuple(sorted(labels.items()))


def exposition(families: Iterable[Snapshot]) -> str:
    """The families in the Prometheus text format, as Triton writes them (see the module docstring)."""
    lines = []
    for family in families:
        name = family["name"]
        description = family["description"].replace("\\", "\\\\").replace("\n", "\\n")
        lines += [f"# HELP {name} {description}", f"# TYPE {name} {family['kind']}"]
        for series in family["series"]:
            labels = sorted(series["labels"].items())
            if "value" not in series:
                lines += _histogram_lines(name, labels, series)
                continue
            lines.append(f"{name}{_labels(labels)} {number(series['value'])}")
    return "".join(line + "\n" for line in lines)


def _histogram_lines(name: str, labels: list[tuple[str, str]], series: Mapping[str, Any]) -> list[str]:
    counts = series["counts"]
    lines = [
        f"{name}_count{_labels(labels)} {sum(counts)}",
        f"{name}_sum{_labels(labels)} {number(series['sum'])}",
    ]
    cumulative = 0
    for bound, count in zip([*series["buckets"], math.inf], counts, strict=True):
        cumulative += count
        lines.append(f"{name}_bucket{_labels([*labels, ('le', number(bound))])} {cumulative}")
    return lines


def _labels(labels: Sequence[tuple[str, str]]) -> str:
    if not labels:
        return ""
    escaped = (value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for _, value in labels)
    return "{" + ",".join(f'{key}="{value}"' for (key, _), value in zip(labels, escaped, strict=True)) + "}"


def number(value: float) -> str:
    """`value` as prometheus-cpp writes it: C's `%.16g` (integers without a point, 16 significant digits at
    most, trailing zeros dropped: `5.5`, `17`, `100000`, `1e+16`), and `Nan`, `+Inf`, `-Inf`."""
    if math.isnan(value):
        return "Nan"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return format(value, ".16g")


def families_handler(
    source: Callable[[], Coroutine[Any, Any, list[Snapshot]]],
) -> grpc.GenericRpcHandler:
    """The gRPC handler of `FAMILIES_METHOD`: `source`'s families as JSON (UTF-8)."""

    async def families(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return json.dumps(await source()).encode()

    return grpc.method_handlers_generic_handler(
        FAMILIES_SERVICE, {FAMILIES_RPC: grpc.unary_unary_rpc_method_handler(families)}
    )


def families_of(reply: bytes) -> list[Snapshot]:
    """The families a `FAMILIES_METHOD` reply carries; `ValueError` when it is not what the method sends."""
    families = json.loads(reply)
    if not isinstance(families, list) or not all(
        isinstance(f, dict) and {"name", "description", "kind", "series"} <= set(f) for f in families
    ):
        raise ValueError("not a list of metric families")
    return families

"""What `--load-model` names, as Triton's explicit model control loads it at start-up: a named ensemble with
every model its steps call (an ensemble among them with its own, and so on), and a named model alone; `*`
alone names everything. The router serves the ensembles of a selection; each stage service loads the models
of it that run there (`pipeline run` gives each its own)."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable, Mapping

from pipeline.ensemble.plan import Catalog, EnsemblePlan

#: Triton's `--load-model=*`: every model.
EVERYTHING = "*"


def named(names: Iterable[str]) -> list[str] | None:
    """The names given (blanks dropped), or None where they name everything: none given, or `*`."""
    given = [name.strip() for name in names if name.strip()]
    return None if not given or EVERYTHING in given else given


def selection(names: Iterable[str], plans: Mapping[str, EnsemblePlan]) -> tuple[set[str], set[str]]:
    """The ensembles and the other models that `names` select among the ensembles `plans`: the names, and
    what the steps of each ensemble selected call."""
    ensembles: set[str] = set()
    models: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        if name in ensembles or name in models:
            continue
        plan = plans.get(name)
        if plan is None:
            models.add(name)
            continue
        ensembles.add(name)
        pending.extend(step.model_name for step in plan.steps)
    return ensembles, models


def selected(catalog: Catalog, names: Iterable[str]) -> Catalog:
    """The catalog with only the ensembles `names` select (those that failed to load included), the whole
    catalog where they name everything (see `named`)."""
    wanted = named(names)
    if wanted is None:
        return catalog
    ensembles, _ = selection(wanted, catalog.ensembles)
    failed = {name: reason for name, reason in catalog.failed.items() if name in wanted or name in ensembles}
    return dataclasses.replace(
        catalog,
        ensembles=types.MappingProxyType({n: p for n, p in catalog.ensembles.items() if n in ensembles}),
        failed=types.MappingProxyType(failed),
    )

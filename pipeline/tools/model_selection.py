"""`pipeline run --load-model`: the models each stage service loads at start-up, as Triton's explicit model
control loads the models named (an ensemble with the models its steps call: `pipeline.ensemble.selection`).

Each stage service is given the models of the selection that run there, where it would place them itself
(`pipeline.stage.placement`), so a Python model is loaded by one service and not by each that could run it;
the router is given the names, and serves the ensembles they select.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pipeline.ensemble.catalog import Failure, load_sources
from pipeline.ensemble.plan import EnsemblePlan
from pipeline.ensemble.selection import named, selection
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.placement import MODEL_SERVICE, PYTHON_SERVICES, model_service_models, python_models_of


def _sources(model_dir: Path, ensembles: Path) -> tuple[dict[str, EnsemblePlan], set[str]]:
    """The ensembles of the repository and of the folder `ensembles` that load, and the names of those that
    do not."""
    loaded = load_sources([ensembles], repository=model_dir)
    plans = {item.name: item for item in loaded if isinstance(item, EnsemblePlan)}
    return plans, {item.name for item in loaded if isinstance(item, Failure)}


def unknown_names(names: Iterable[str], model_dir: Path, ensembles: Path) -> list[str]:
    """The names that are neither a model of the repository at `model_dir` nor an ensemble there or in the
    folder `ensembles`."""
    wanted = named(names)
    if wanted is None:
        return []
    plans, failed = _sources(model_dir, ensembles)
    return sorted(set(wanted) - {*ModelRepository(model_dir).names(), *plans, *failed})


def stage_models(names: Iterable[str], model_dir: Path, ensembles: Path) -> dict[str, list[str]] | None:
    """Stage service -> the models it loads at start-up, among those `names` select in the repository at
    `model_dir` with the YAML ensembles of the folder `ensembles`; None where the names name everything."""
    wanted = named(names)
    if wanted is None:
        return None
    plans, _ = _sources(model_dir, ensembles)
    _, models = selection(wanted, plans)
    repository = ModelRepository(model_dir)
    runs = {MODEL_SERVICE: model_service_models(repository)}
    for service in PYTHON_SERVICES:
        runs[service] = python_models_of(service, repository, plans.values())
    return {service: sorted(set(served) & models) for service, served in runs.items()}


def load_model_flags(models: list[str]) -> list[str]:
    """A stage service's `--load-model` flags for `models`; a blank one alone where it loads none."""
    return [f"--load-model={name}" for name in models] or ["--load-model="]

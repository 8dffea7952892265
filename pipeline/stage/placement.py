"""Which of the two Python stage services serves which Python model of a repository.

The pipeline runs `model.py` models in two services, `preprocess` and `postprocess`, scaled apart. Each
Python model is loaded by exactly one of them, decided here once, from the ensembles that call it:

- a step whose ensemble names its stage `preprocess` or `postprocess` (a YAML ensemble) is served there;
- otherwise (a `config.pbtxt` ensemble names no stage) a step that runs after a step of a model that is
  not a Python model of the repository (one the model service runs: ONNX, PyTorch, TensorRT; or another
  server's) or after a decoupled Python model (a generator: what follows handles each of its responses),
  directly or through other steps, is `postprocess`'s, and any other is `preprocess`'s;
- a Python model that no ensemble calls is `preprocess`'s.

Where ensembles disagree, the first that calls the model (by ensemble name) decides. `--load-model`
(Triton's explicit model control) overrides all of this for a service.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable, Mapping

from pipeline.ensemble.plan import EnsemblePlan, PlanStep
from pipeline.runtime.repository import BACKEND_PLATFORMS, ModelRepository, RepositoryEntry

log = logging.getLogger(__name__)

#: The Python stage services, in the order requests pass them.
PYTHON_SERVICES = ("preprocess", "postprocess")


def place_python_models(
    python_models: Iterable[str],
    backends: Mapping[str, str],
    plans: Iterable[EnsemblePlan],
    decoupled: Container[str] = (),
) -> dict[str, str]:
    """Python model -> the service (`preprocess` or `postprocess`) that serves it. `backends` gives the
    backend of each repository model (to tell the model service's steps from the Python ones); `decoupled`
    names the decoupled Python models."""
    python = set(python_models)
    placed: dict[str, tuple[str, str]] = {}
    for plan in sorted(plans, key=lambda p: p.name):
        steps = {step.index: step for step in plan.steps}
        for step in plan.steps:
            if step.model_name not in python:
                continue
            service = _service_of(step, steps, backends, decoupled)
            earlier = placed.setdefault(step.model_name, (service, plan.name))
            if earlier[0] != service:
                log.warning(
                    "python model '%s' runs in the %s of ensemble '%s' and the %s of ensemble '%s': served by "
                    "%s (give --load-model to choose)",
                    step.model_name,
                    earlier[0],
                    earlier[1],
                    service,
                    plan.name,
                    earlier[0],
                )
    return {name: placed.get(name, (PYTHON_SERVICES[0], ""))[0] for name in sorted(python)}


def _service_of(
    step: PlanStep, steps: Mapping[int, PlanStep], backends: Mapping[str, str], decoupled: Container[str]
) -> str:
    if step.stage in PYTHON_SERVICES:
        return step.stage
    pending, seen = list(step.depends_on), set()
    while pending:
        index = pending.pop()
        if index in seen:
            continue
        seen.add(index)
        earlier = steps[index]
        name = earlier.model_name
        if earlier.stage == "model" or backends.get(name) != "python" or name in decoupled:
            return PYTHON_SERVICES[1]
        pending.extend(earlier.depends_on)
    return PYTHON_SERVICES[0]


def python_models_of(service: str, repository: ModelRepository, plans: Iterable[EnsemblePlan]) -> list[str]:
    """The Python models of `repository` that `service` serves (see the module docstring)."""
    entries = {
        name: e for name, e in repository.entries(BACKEND_PLATFORMS).items() if isinstance(e, RepositoryEntry)
    }
    backends = {name: entry.backend for name, entry in entries.items()}
    python = [name for name, backend in backends.items() if backend == "python"]
    decoupled = {name for name in python if entries[name].config.model_transaction_policy.decoupled}
    placement = place_python_models(python, backends, plans, decoupled)
    return [name for name, placed in placement.items() if placed == service]

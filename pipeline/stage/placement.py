"""Which stage service serves which Python model of a repository.

The pipeline runs `model.py` models in three services: `preprocess` and `postprocess`, scaled apart, and the
model service, which has the devices. Each Python model is loaded by exactly one of them, decided here once:

- a Python model whose config asks for devices (`instance_group [ { kind: KIND_GPU } ]`, which on Triton
  puts its instances on GPUs) is the model service's, beside the ONNX, PyTorch and TensorRT models, so it
  runs where the GPUs are (on the CPU where there are none: `pipeline.stage.model_file.instance_placements`).
  Its config alone decides, so the model service needs no ensembles to know it. So is a TorchServe archive's
  model (`pipeline.runtime.torchserve_store`): its handler runs torch, which the model service's image has
  and the Python services' images do not. A split handler's inference model is too; its preprocess and
  postprocess models go where their ensemble's steps put them, as any other Python model's;
- a step whose ensemble names its stage `preprocess` or `postprocess` (a YAML ensemble) is served there;
- otherwise (a `config.pbtxt` ensemble names no stage) a step that runs after a step of the model service
  (a model that is not a Python model of the repository: ONNX, PyTorch, TensorRT, or another server's; or
  a Python model that asks for devices) or after a decoupled Python model (a generator: what follows
  handles each of its responses), directly or through other steps, is `postprocess`'s, and any other is
  `preprocess`'s;
- a Python model that no ensemble calls is `preprocess`'s.

Where ensembles disagree, the first that calls the model (by ensemble name) decides. `--load-model`
(Triton's explicit model control) overrides all of this for a service.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable, Mapping

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.ensemble.plan import EnsemblePlan, PlanStep
from pipeline.protocol.errors import RepositoryError
from pipeline.runtime.repository import BACKEND_PLATFORMS, ModelRepository, RepositoryEntry
from pipeline.runtime.torchserve_store import ARCHIVE_PARAMETER, PART_PARAMETER, PARTS

log = logging.getLogger(__name__)

#: The Python stage services, in the order requests pass them.
PYTHON_SERVICES = ("preprocess", "postprocess")
#: The service with the devices: ONNX, PyTorch and TensorRT models, and the Python models that ask for GPUs.
MODEL_SERVICE = "model"


def asks_for_devices(config: mc.ModelConfig) -> bool:
    """Whether a config's `instance_group` asks for GPU instances (`KIND_GPU`)."""
    return any(group.kind == mc.ModelInstanceGroup.KIND_GPU for group in config.instance_group)


def on_model_service(config: mc.ModelConfig) -> bool:
    """Whether the model service serves a Python model: it asks for devices, or runs a TorchServe archive's
    handler (or its inference method, where the handler is split)."""
    parameters = config.parameters
    part = parameters[PART_PARAMETER].string_value if PART_PARAMETER in parameters else PARTS[1]
    return asks_for_devices(config) or (ARCHIVE_PARAMETER in parameters and part == PARTS[1])


def place_python_models(
    python_models: Iterable[str],
    backends: Mapping[str, str],
    plans: Iterable[EnsemblePlan],
    decoupled: Container[str] = (),
    devices: Container[str] = (),
) -> dict[str, str]:
    """Python model -> the service (`preprocess`, `model` or `postprocess`) that serves it. `backends` gives
    the backend of each repository model (to tell the model service's steps from the Python ones);
    `decoupled` names the decoupled Python models, `devices` those that ask for GPUs."""
    python = set(python_models)
    placed: dict[str, tuple[str, str]] = {}
    for plan in sorted(plans, key=lambda p: p.name):
        steps = {step.index: step for step in plan.steps}
        for step in plan.steps:
            if step.model_name not in python:
                continue
            if step.model_name in devices:
                if step.stage in PYTHON_SERVICES:
                    log.warning(
                        "python model '%s' asks for GPUs (instance_group kind KIND_GPU), so the model service "
                        "serves it, but ensemble '%s' names the stage %s for it",
                        step.model_name,
                        plan.name,
                        step.stage,
                    )
                continue
            service = _service_of(step, steps, backends, decoupled, devices)
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
    return {
        name: MODEL_SERVICE if name in devices else placed.get(name, (PYTHON_SERVICES[0], ""))[0]
        for name in sorted(python)
    }


def _service_of(
    step: PlanStep,
    steps: Mapping[int, PlanStep],
    backends: Mapping[str, str],
    decoupled: Container[str],
    devices: Container[str],
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
        if (
            earlier.stage == MODEL_SERVICE
            or backends.get(name) != "python"
            or name in decoupled
            or name in devices
        ):
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
    devices = {name for name in python if on_model_service(entries[name].config)}
    placement = place_python_models(python, backends, plans, decoupled, devices)
    return [name for name, placed in placement.items() if placed == service]


def model_service_models(repository: ModelRepository) -> list[str]:
    """What the model service loads at start-up: the models of `repository` that are neither Python models
    that run in the Python services nor ensembles (one it cannot read too: whose it is cannot be told, so it
    is reported)."""
    return [name for name, entry in repository.entries(BACKEND_PLATFORMS).items() if _in_model_service(entry)]


def _in_model_service(entry: RepositoryEntry | RepositoryError) -> bool:
    if isinstance(entry, RepositoryError):
        return True
    if entry.backend == "python":
        return on_model_service(entry.config)
    return entry.backend != "ensemble"


def unplaced_python_models(repository: ModelRepository) -> list[str]:
    """What a Python service loads where the ensembles cannot be read: every Python model but those the
    model service runs (and any model it cannot read, which it reports)."""
    python = repository.entries(("python",))
    return [
        n for n, e in python.items() if not (isinstance(e, RepositoryEntry) and on_model_service(e.config))
    ]

"""What the router serves: ensemble files and folders, a model repository's ensembles and the stages given
by key (`--stage`), gathered into one `Catalog` and checked together for what no single file can say.

A model repository holds ensembles of two kinds, each in a folder of its own as every model is, so that one
folder is one deployable unit: Triton's (`<repository>/<ensemble>/config.pbtxt`, `platform: "ensemble"`) and
YAML ones (`<repository>/<ensemble>/ensemble.yaml`, named by their folder). A folder of YAML files
(`ensembles/`, `--ensembles`) may add more; an empty or missing folder adds none.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Iterable, Mapping
from pathlib import Path

from pipeline.ensemble.compiler import compile_ensemble
from pipeline.ensemble.loader import read_yaml, validate_stage_address
from pipeline.ensemble.pbtxt import load_repository_ensembles
from pipeline.ensemble.plan import Catalog, EnsemblePlan, StageEndpoint
from pipeline.protocol.errors import ConfigError
from pipeline.protocol.types import BatchingConfig
from pipeline.runtime.repository import CONFIG_FILE

log = logging.getLogger(__name__)

#: The file of a YAML ensemble in a model repository: `<repository>/<ensemble>/ensemble.yaml`.
ENSEMBLE_FILE = "ensemble.yaml"


def stage_endpoints(
    addresses: Mapping[str, str], *, environ: Mapping[str, str] | None = None
) -> dict[str, StageEndpoint]:
    """Stage endpoints given to the router by key (`--stage NAME=ADDRESS`), each address checked as an
    ensemble file's `stages` entry is."""
    return {
        key: StageEndpoint(key, validate_stage_address(key, address, environ=environ))
        for key, address in addresses.items()
    }


def load_ensemble(path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> EnsemblePlan:
    """Load, validate and compile one ensemble file; its name defaults to the file's stem.

    `environ` (default `os.environ`) expands `${VAR}` and `${VAR:-default}` in stage addresses.
    """
    source = os.fspath(path)
    file = Path(source)
    return compile_ensemble(read_yaml(file, source), source, default_name=file.stem, environ=environ)


def ensemble_files(paths_or_dir: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[str]:
    """The YAML files of `paths_or_dir`: each file given, and each folder's `*.yaml` and `*.yml` (sorted). A
    folder that is empty or missing gives none; a missing file is an error."""
    if isinstance(paths_or_dir, str | os.PathLike):
        paths_or_dir = [paths_or_dir]
    files: list[str] = []
    for entry in paths_or_dir:
        entry_path = Path(entry)
        if entry_path.is_dir():
            found = sorted(p for p in entry_path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
            if not found:
                log.info("%s: no ensemble files in the folder", os.fspath(entry))
            files.extend(os.fspath(p) for p in found)
        elif entry_path.suffix in (".yaml", ".yml") or entry_path.exists():
            files.append(os.fspath(entry))  # a file that is not there is the loader's to report
        else:
            log.info("%s: no such folder, so no ensemble files from it", os.fspath(entry))
    return files


def repository_ensembles(
    root: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> list[EnsemblePlan]:
    """Every ensemble of a model repository: its `config.pbtxt` ensembles, then its YAML ones
    (`<ensemble>/ensemble.yaml`, whose name is the folder's), each sorted by name."""
    plans = load_repository_ensembles(root)
    folder = Path(root)
    children = sorted(folder.iterdir()) if folder.is_dir() else []
    for child in children:
        path = child / ENSEMBLE_FILE
        if child.name.startswith(".") or not path.is_file():
            continue
        source = os.fspath(path)
        if (child / CONFIG_FILE).exists():
            raise ConfigError(
                f"{source}: its folder also holds a {CONFIG_FILE}; a folder of the repository is one model or "
                "one ensemble"
            )
        plan = compile_ensemble(read_yaml(path, source), source, default_name=child.name, environ=environ)
        if plan.name != child.name:
            raise ConfigError(
                f"{source}: name '{plan.name}' differs from its folder's name '{child.name}' (the folder names "
                "the ensemble, as it names a model)"
            )
        plans.append(plan)
    return plans


def ensemble_plans(
    ensembles: Iterable[str | os.PathLike[str]] = (),
    *,
    repository: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[EnsemblePlan]:
    """The ensembles of the YAML files and folders `ensembles`, then those of the model `repository`."""
    plans = [load_ensemble(file, environ=environ) for file in ensemble_files(ensembles)]
    if repository is not None:
        plans += repository_ensembles(repository, environ=environ)
    return plans


def load_ensembles(
    paths_or_dir: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    environ: Mapping[str, str] | None = None,
) -> Catalog:
    """Load every ensemble of a directory (its `*.yaml` and `*.yml`, sorted) or of a list of files and dirs.

    Checks what no single file can (see `build_catalog`).
    """
    files = ensemble_files(paths_or_dir)
    if not files:
        given = [paths_or_dir] if isinstance(paths_or_dir, str | os.PathLike) else list(paths_or_dir)
        named = ", ".join(str(os.fspath(path)) for path in given)
        raise ConfigError(f"no ensemble files in {named or 'nothing given'}")
    return build_catalog([load_ensemble(file, environ=environ) for file in files])


def load_catalog(
    ensembles: Iterable[str | os.PathLike[str]] = (),
    *,
    repository: str | os.PathLike[str] | None = None,
    stages: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Catalog:
    """What the router serves: the YAML ensembles of `ensembles` (files or folders), the ensembles of the
    model `repository` (`config.pbtxt` and `ensemble.yaml` ones), and the stage endpoints `stages` (key:
    address) beside those the YAML files declare."""
    plans = ensemble_plans(ensembles, repository=repository, environ=environ)
    endpoints = stage_endpoints(stages or {}, environ=environ)
    if not plans and not endpoints:
        raise ConfigError(
            "nothing to serve: no ensemble files, no ensemble in the model repository, and no stages"
        )
    return build_catalog(plans, endpoints)


#: Stage key -> (its endpoint, the file that declares it, or `--stage`).
_Endpoints = dict[str, tuple[StageEndpoint, str]]
#: Model name -> (its stage, the file and the step label that name it).
_Models = dict[str, tuple[str, str, str]]
#: Model name -> (its batching, whether the model's own applies, where that is set).
_Batching = dict[str, tuple[BatchingConfig | None, bool, str]]


def build_catalog(
    plans: Iterable[EnsemblePlan], stages: Mapping[str, StageEndpoint] | None = None
) -> Catalog:
    """A catalog of compiled ensembles (from YAML files and model repositories alike) and the router's own
    `stages`. Checks what no single file can: unique ensemble names, one address per stage key, one stage
    per model name, one batching setting per model, and no ensemble named like a stage model (the router
    serves both in one namespace).
    """
    plans = list(plans)
    ensembles: dict[str, EnsemblePlan] = {}
    endpoints: _Endpoints = {key: (endpoint, "--stage") for key, endpoint in (stages or {}).items()}
    models: _Models = {}
    batching: _Batching = {}
    errors: list[str] = []
    for plan in plans:
        if plan.name in ensembles:
            errors.append(
                f"{plan.source}: ensemble '{plan.name}' is also defined in {ensembles[plan.name].source}; "
                f"ensemble names must be unique"
            )
        else:
            ensembles[plan.name] = plan
        errors += _stage_conflicts(plan, endpoints)
        errors += _model_conflicts(plan, models, batching)
    errors += _ensembles_named_like_models(plans)
    if errors:
        raise ConfigError("\n".join(errors))
    return Catalog(
        ensembles=types.MappingProxyType(ensembles),
        stages=types.MappingProxyType({key: endpoint for key, (endpoint, _) in endpoints.items()}),
    )


def _stage_conflicts(plan: EnsemblePlan, endpoints: _Endpoints) -> list[str]:
    """The plan's stages against those declared before (adding the new ones): one endpoint per key."""
    errors: list[str] = []
    for key, endpoint in plan.stages.items():
        first, first_file = endpoints.get(key, (None, ""))
        if first is None or (first_file == "--stage" and first.address == endpoint.address):
            # A file may say more of a stage given by `--stage` (its limits).
            endpoints[key] = (endpoint, plan.source)
        elif first.address != endpoint.address:
            errors.append(
                f"{plan.source}: stage '{key}' has address '{endpoint.address}', "
                f"but {first_file} declares it with address '{first.address}'; "
                "a stage key must name one endpoint"
            )
        elif first.max_inflight_requests != endpoint.max_inflight_requests:
            errors.append(
                f"{plan.source}: stage '{key}' has max_inflight_requests {endpoint.max_inflight_requests}, "
                f"but {first_file} declares {first.max_inflight_requests}; a stage has one limit"
            )
    return errors


def _model_conflicts(plan: EnsemblePlan, models: _Models, batching: _Batching) -> list[str]:
    """The plan's steps against the models named before (adding the new ones): a model has one batching
    setting and one stage."""
    errors: list[str] = []
    for step in sorted(plan.steps, key=lambda s: s.index):
        where = f"{plan.source} ({step.label})"
        first_batching, first_model, first_where = batching.setdefault(
            step.model_name, (step.batching, step.model_batching, where)
        )
        if (first_batching, first_model) != (step.batching, step.model_batching):
            errors.append(
                f"{where}: model '{step.model_name}' has dynamic_batching "
                f"{_describe(step.batching, step.model_batching)} here but "
                f"{_describe(first_batching, first_model)} in {first_where}; a model has one batcher, "
                "so one setting"
            )
        if not step.stage:
            continue
        if step.model_name not in models:
            models[step.model_name] = (step.stage, plan.source, step.label)
        elif models[step.model_name][0] != step.stage:
            stage, file, label = models[step.model_name]
            errors.append(
                f"{plan.source}: {step.label}: model '{step.model_name}' "
                f"is served by stage '{step.stage}' here but by stage '{stage}' in {file} ({label}); "
                "a model name must have one stage"
            )
    return errors


def _ensembles_named_like_models(plans: list[EnsemblePlan]) -> list[str]:
    """Ensembles named like a stage model of another file (its own steps are the compiler's business)."""
    errors: list[str] = []
    step_models = {step.model_name: (plan.source, step.label) for plan in plans for step in plan.steps}
    for plan in plans:
        if plan.name in step_models and step_models[plan.name][0] != plan.source:
            file, label = step_models[plan.name]
            errors.append(
                f"{plan.source}: ensemble name '{plan.name}' is also a stage model name ({file}, {label}); "
                f"the router serves ensembles and stage models in one namespace"
            )
    return errors


def _describe(batching: BatchingConfig | None, model_batching: bool) -> str:
    if batching is None:
        return "the model's own (none set)" if model_batching else "off"
    return f"({batching})"

"""What the router serves: ensemble files and folders, a model repository's ensembles and the stages given
by key (`--stage`), gathered into one `Catalog` and checked together for what no single file can say.

A model repository holds ensembles of two kinds, each in a folder of its own as every model is, so that one
folder is one deployable unit: Triton's (`<repository>/<ensemble>/config.pbtxt`, `platform: "ensemble"`) and
YAML ones (`<repository>/<ensemble>/ensemble.yaml`, named by their folder). A folder of YAML files
(`ensembles/`, `--ensembles`) may add more; an empty or missing folder adds none.
"""

from __future__ import annotations

import hashlib
import logging
import os
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.ensemble.compiler import compile_ensemble
from pipeline.ensemble.loader import read_yaml, validate_stage_address
from pipeline.ensemble.pbtxt import load_repository_ensembles
from pipeline.ensemble.plan import Catalog, EnsemblePlan, PlanStep, StageEndpoint
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


@dataclass(frozen=True, slots=True)
class Failure:
    """An ensemble that does not load: its name (as its file says, else the file's or folder's) and why, in
    words that name the file."""

    name: str
    #: The file.
    source: str
    reason: str


#: What loading one ensemble gives: its plan, or why there is none.
Loaded = EnsemblePlan | Failure


def _load_file(path: Path, source: str, default_name: str, environ: Mapping[str, str] | None) -> Loaded:
    """One YAML ensemble compiled, or its failure under the name it gives itself (else `default_name`)."""
    data: Any = None
    try:
        data = read_yaml(path, source)
        return compile_ensemble(data, source, default_name=default_name, environ=environ)
    except ConfigError as err:
        named = data.get("name") if isinstance(data, dict) else None
        return Failure(named if isinstance(named, str) and named else default_name, source, str(err))


def ensemble_files(
    paths_or_dir: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *, quiet: bool = False
) -> list[str]:
    """The YAML files of `paths_or_dir`: each file given, and each folder's `*.yaml` and `*.yml` (sorted). A
    folder that is empty or missing gives none (logged, unless `quiet`); a missing file is an error."""
    if isinstance(paths_or_dir, str | os.PathLike):
        paths_or_dir = [paths_or_dir]
    files: list[str] = []
    for entry in paths_or_dir:
        entry_path = Path(entry)
        if entry_path.is_dir():
            found = sorted(p for p in entry_path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
            if not found and not quiet:
                log.info("%s: no ensemble files in the folder", os.fspath(entry))
            files.extend(os.fspath(p) for p in found)
        elif entry_path.suffix in (".yaml", ".yml") or entry_path.exists():
            files.append(os.fspath(entry))  # a file that is not there is the loader's to report
        elif not quiet:
            log.info("%s: no such folder, so no ensemble files from it", os.fspath(entry))
    return files


def repository_ensembles(
    root: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> list[Loaded]:
    """Every ensemble of a model repository, loaded or failed: its `config.pbtxt` ensembles, then its YAML ones
    (`<ensemble>/ensemble.yaml`, whose name is the folder's), each sorted by name."""
    failed: dict[str, ConfigError] = {}
    loaded: list[Loaded] = list(load_repository_ensembles(root, failed=failed))
    loaded += [
        Failure(name, os.fspath(Path(root) / name / CONFIG_FILE), str(err))
        for name, err in sorted(failed.items())
    ]
    folder = Path(root)
    children = sorted(folder.iterdir()) if folder.is_dir() else []
    for child in children:
        path = child / ENSEMBLE_FILE
        if child.name.startswith(".") or not path.is_file():
            continue
        source = os.fspath(path)
        if (child / CONFIG_FILE).exists():
            loaded.append(
                Failure(
                    child.name,
                    source,
                    f"{source}: its folder also holds a {CONFIG_FILE}; a folder of the repository is one model "
                    "or one ensemble",
                )
            )
            continue
        plan = _load_file(path, source, child.name, environ)
        if isinstance(plan, EnsemblePlan) and plan.name != child.name:
            plan = Failure(
                child.name,
                source,
                f"{source}: name '{plan.name}' differs from its folder's name '{child.name}' (the folder names "
                "the ensemble, as it names a model)",
            )
        loaded.append(plan)
    return loaded


def load_sources(
    ensembles: Iterable[str | os.PathLike[str]] = (),
    *,
    repository: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[Loaded]:
    """Every ensemble of the YAML files and folders `ensembles`, then of the model `repository`, each loaded
    or failed on its own."""
    loaded = [_load_file(Path(file), file, Path(file).stem, environ) for file in ensemble_files(ensembles)]
    if repository is not None:
        loaded += repository_ensembles(repository, environ=environ)
    return loaded


def sources_digest(
    ensembles: Iterable[str | os.PathLike[str]] = (), *, repository: str | os.PathLike[str] | None = None
) -> str:
    """A digest of every file the ensembles are read from (the YAML files of `ensembles`, and each
    `config.pbtxt` and `ensemble.yaml` of the model `repository`): it changes when one of them is written,
    added or removed."""
    files = [Path(file) for file in ensemble_files(ensembles, quiet=True)]
    if repository is not None and Path(repository).is_dir():
        for child in sorted(Path(repository).iterdir()):
            files += [child / CONFIG_FILE, child / ENSEMBLE_FILE]
    digest = hashlib.sha256()
    for file in files:
        try:
            content = file.read_bytes()
        except OSError:
            continue  # not there (or not readable): the loader says so where it matters
        digest.update(f"{file}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


def ensemble_plans(
    ensembles: Iterable[str | os.PathLike[str]] = (),
    *,
    repository: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[EnsemblePlan]:
    """The ensembles of the YAML files and folders `ensembles`, then those of the model `repository`;
    `ConfigError` naming every one that does not load."""
    loaded = load_sources(ensembles, repository=repository, environ=environ)
    failures = [item.reason for item in loaded if isinstance(item, Failure)]
    if failures:
        raise ConfigError("\n".join(failures))
    return [item for item in loaded if isinstance(item, EnsemblePlan)]


def load_ensembles(
    paths_or_dir: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    environ: Mapping[str, str] | None = None,
    exit_on_error: bool = True,
) -> Catalog:
    """Load every ensemble of a directory (its `*.yaml` and `*.yml`, sorted) or of a list of files and dirs.

    Checks what no single file can (see `build_catalog`).
    """
    files = ensemble_files(paths_or_dir)
    if not files:
        given = [paths_or_dir] if isinstance(paths_or_dir, str | os.PathLike) else list(paths_or_dir)
        named = ", ".join(str(os.fspath(path)) for path in given)
        raise ConfigError(f"no ensemble files in {named or 'nothing given'}")
    loaded = [_load_file(Path(file), file, Path(file).stem, environ) for file in files]
    return build_catalog(loaded, exit_on_error=exit_on_error)


def load_catalog(
    ensembles: Iterable[str | os.PathLike[str]] = (),
    *,
    repository: str | os.PathLike[str] | None = None,
    stages: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    exit_on_error: bool = True,
) -> Catalog:
    """What the router serves: the YAML ensembles of `ensembles` (files or folders), the ensembles of the
    model `repository` (`config.pbtxt` and `ensemble.yaml` ones), and the stage endpoints `stages` (key:
    address) beside those the YAML files declare. `exit_on_error` as `build_catalog`'s."""
    loaded = load_sources(ensembles, repository=repository, environ=environ)
    endpoints = stage_endpoints(stages or {}, environ=environ)
    if not loaded and not endpoints:
        raise ConfigError(
            "nothing to serve: no ensemble files, no ensemble in the model repository, and no stages"
        )
    catalog = build_catalog(loaded, endpoints, exit_on_error=exit_on_error)
    return catalog if repository is None else replace(catalog, repository=os.fspath(repository))


#: Stage key -> (its endpoint, the file that declares it, or `--stage`).
_Endpoints = dict[str, tuple[StageEndpoint, str]]
#: Model name -> (its stage, the file and the step label that name it).
_Models = dict[str, tuple[str, str, str]]
#: Model name -> (the batching an ensemble states for it, None for off; where it says so).
_Batching = dict[str, tuple[BatchingConfig | None, str]]


def build_catalog(
    loaded: Iterable[Loaded],
    stages: Mapping[str, StageEndpoint] | None = None,
    *,
    exit_on_error: bool = True,
) -> Catalog:
    """A catalog of compiled ensembles (from YAML files and model repositories alike) and the router's own
    `stages`. Checks what no single file can: unique ensemble names, one address per stage key, one stage
    per model name, one batching setting per model, and no ensemble named like a stage model (the router
    serves both in one namespace). An ensemble that fails a check fails alone (the files are taken in
    order: the later one of two that disagree): `exit_on_error` raises `ConfigError` naming every failure,
    else the catalog lists them in `failed` and serves the others.
    """
    loaded = list(loaded)
    plans = [item for item in loaded if isinstance(item, EnsemblePlan)]
    failed: dict[str, str] = {item.name: item.reason for item in loaded if isinstance(item, Failure)}
    sources = {item.name: item.source for item in loaded if isinstance(item, Failure)}
    named_like_models = _ensembles_named_like_models(plans)
    ensembles: dict[str, EnsemblePlan] = {}
    endpoints: _Endpoints = {key: (endpoint, "--stage") for key, endpoint in (stages or {}).items()}
    models: _Models = {}
    batching: _Batching = {}
    for plan in plans:
        errors = list(named_like_models.get(plan.name, ()))
        if plan.name in sources:
            errors.append(
                f"{plan.source}: ensemble '{plan.name}' is also defined in {sources[plan.name]}; "
                f"ensemble names must be unique"
            )
            ensembles.pop(plan.name, None)
        trial = (dict(endpoints), dict(models), dict(batching))
        errors += _stage_conflicts(plan, trial[0])
        errors += _model_conflicts(plan, trial[1], trial[2])
        sources.setdefault(plan.name, plan.source)
        if errors:
            failed[plan.name] = "\n".join(errors)
            continue
        if plan.name not in failed:
            ensembles[plan.name] = plan
        endpoints, models, batching = trial
    if failed and exit_on_error:
        raise ConfigError("\n".join(failed.values()))
    return Catalog(
        ensembles=types.MappingProxyType(ensembles),
        stages=types.MappingProxyType({key: endpoint for key, (endpoint, _) in endpoints.items()}),
        failed=types.MappingProxyType(failed),
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


def stated_batching(step: PlanStep) -> tuple[bool, BatchingConfig | None]:
    """Whether an ensemble states the batching of a step's model, and what: its settings, or None where it
    turns batching off. Where it states none, the model's own applies (or another ensemble's)."""
    return (step.batching is not None or not step.model_batching), step.batching


def declared_batching(plans: Iterable[EnsemblePlan]) -> _Batching:
    """Model -> the batching the ensembles state for it (None: off) and the first file and step that state
    it; `build_catalog` has checked that they agree."""
    declared: _Batching = {}
    for plan in plans:
        for step in sorted(plan.steps, key=lambda s: s.index):
            states, stated = stated_batching(step)
            if states:
                declared.setdefault(step.model_name, (stated, f"{plan.source} ({step.label})"))
    return declared


def _model_conflicts(plan: EnsemblePlan, models: _Models, batching: _Batching) -> list[str]:
    """The plan's steps against the models named before (adding the new ones): where ensembles state a
    model's batching they state one setting, and a model has one stage."""
    errors: list[str] = []
    for step in sorted(plan.steps, key=lambda s: s.index):
        where = f"{plan.source} ({step.label})"
        states, stated = stated_batching(step)
        if states:
            first, first_where = batching.setdefault(step.model_name, (stated, where))
            if first != stated:
                errors.append(
                    f"{where}: model '{step.model_name}' has dynamic_batching {describe_batching(stated)} "
                    f"here but {describe_batching(first)} in {first_where}; a model has one batcher, so one "
                    "setting: declare it once, in the model's config.pbtxt"
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


def _ensembles_named_like_models(plans: list[EnsemblePlan]) -> dict[str, list[str]]:
    """Ensembles named like a stage model of another file (its own steps are the compiler's business)."""
    errors: dict[str, list[str]] = {}
    step_models = {step.model_name: (plan.source, step.label) for plan in plans for step in plan.steps}
    for plan in plans:
        if plan.name in step_models and step_models[plan.name][0] != plan.source:
            file, label = step_models[plan.name]
            errors.setdefault(plan.name, []).append(
                f"{plan.source}: ensemble name '{plan.name}' is also a stage model name ({file}, {label}); "
                f"the router serves ensembles and stage models in one namespace"
            )
    return errors


def describe_batching(batching: BatchingConfig | None) -> str:
    """A batching setting in messages: `off`, or its knobs."""
    return "off" if batching is None else f"({batching})"

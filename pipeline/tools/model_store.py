"""`pipeline run --model-store DIR`: TorchServe's model store served as it is.

The archives `--models` names (TorchServe's flag: `all`, or `name=file.mar` / `file.mar` items; none by
default, as TorchServe loads none) become the folders of a model repository that the launcher makes for the
run (`pipeline.runtime.torchserve_store`), with the settings TorchServe's `config.properties` gives them
(`--ts-config`: its `models` JSON, `default_workers_per_model`, and `load_models` where `--models` is not
given); `--split-handlers` runs the handlers it names as three stages
(`pipeline.stage.torchserve.handler_parts`), and an archive's requirements.txt is installed where
config.properties sets `install_py_dep_per_model=true` (refused otherwise, as TorchServe ignores it). Every
service serves that repository; the router answers TorchServe's APIs on its HTTP port and registers further
archives of the store into it.

Where the services run apart (compose.torchserve.yaml), a one-shot process writes those folders into the
repository that every service mounts, before they start:

    python -m pipeline.tools.model_store --model-store /model-store --models all --model-dir /models

It writes (or rewrites) the folder of each archive named and removes those of archives no longer named (a
restart serves what it is told, as TorchServe without its configuration snapshots), leaving every other
model of the repository alone.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Annotated

from pipeline.protocol.errors import ConfigError, PipelineError
from pipeline.runtime.router_settings import TorchServeStore
from pipeline.runtime.service_settings import Repository
from pipeline.runtime.settings_cli import add_arguments, option, process_settings
from pipeline.runtime.torchserve_store import (
    ArchiveModel,
    archive_models,
    has_requirements,
    read_properties,
    remove_model,
    startup_models,
    write_model,
)

log = logging.getLogger(__name__)

#: The folder of a repository where archives' requirements are installed, one folder per model (a dot
#: folder: no model of the repository).
DEPENDENCIES = ".torchserve-dependencies"


class LauncherModelStore(TorchServeStore):
    """`pipeline run --model-store`: the archives served from start-up and TorchServe's configuration."""

    models: Annotated[
        str | None,
        option(
            "--models",
            env="PIPELINE_MODELS",
            help="with --model-store, the archives loaded at start-up, as TorchServe's --models: 'all', or "
            "NAME=FILE.mar / FILE.mar items, comma-separated (env PIPELINE_MODELS; default: none, or "
            "config.properties' load_models)",
        ),
    ] = None
    ts_config: Annotated[
        Path | None,
        option(
            "--ts-config",
            env="PIPELINE_TS_CONFIG",
            parse=Path,
            help="TorchServe's config.properties: its models JSON (batchSize, maxBatchDelay, minWorkers, "
            "maxWorkers, responseTimeout), default_workers_per_model and load_models (env PIPELINE_TS_CONFIG)",
        ),
    ] = None
    split_handlers: Annotated[
        str | None,
        option(
            "--split-handlers",
            env="PIPELINE_SPLIT_HANDLERS",
            metavar="NAMES",
            help="with --model-store, the models (comma-separated, or 'all') whose BaseHandler runs as three "
            "stages: preprocess and postprocess on the CPU services, inference on the model service, joined "
            "by an ensemble of the model's name (env PIPELINE_SPLIT_HANDLERS; default: none, each handler runs "
            "as one stage, as TorchServe runs it)",
        ),
    ] = None


def model_store_repository(settings: LauncherModelStore) -> Path | None:
    """The repository of the run's archives (a new folder the caller removes), None without --model-store;
    `ConfigError` naming what is wrong with the store, the archives or the configuration."""
    if settings.model_store is None:
        return None
    repository = Path(tempfile.mkdtemp(prefix="pipeline-model-store-"))
    write_store_models(settings, repository)
    return repository


def write_store_models(settings: LauncherModelStore, repository: Path) -> list[ArchiveModel]:
    """Write the folders of the archives the settings name (`--models`, else config.properties'
    `load_models`) into `repository`, and remove the folders of archives they no longer name; `ConfigError`
    naming what is wrong with the store, the archives or the configuration (then nothing is written)."""
    store = settings.model_store
    if store is None or not store.is_dir():
        raise ConfigError(f"--model-store {store}: no such folder")
    properties = read_properties(settings.ts_config) if settings.ts_config else {}
    models = settings.models or properties.get("load_models", "")
    try:
        archives = startup_models(store, models, properties, settings.split_handlers or "")
    except (PipelineError, ValueError) as exc:
        raise ConfigError(f"--model-store {store}: {getattr(exc, 'message', exc)}") from None
    named = {archive.name for archive in archives}
    for stale in archive_models(repository):
        if stale.name not in named:
            remove_model(repository, stale.name)
            shutil.rmtree(repository / DEPENDENCIES / stale.name, ignore_errors=True)
    written = []
    for archive in archives:
        if has_requirements(archive):  # allowed: startup_models refuses them otherwise
            archive = replace(archive, dependencies=str(install_requirements(archive, repository)))
        write_model(repository, archive)
        written.append(archive)
    return written


def install_requirements(model: ArchiveModel, repository: Path) -> Path:
    """Install the archive's requirements.txt with pip into a folder of its own in `repository`, as
    TorchServe's `install_py_dep_per_model=true` does (the handler finds them on its path); `ConfigError`
    with pip's last words where pip fails. pip reads its usual settings (`PIP_INDEX_URL`, `PIP_FIND_LINKS`,
    `PIP_NO_INDEX`, pip.conf), and options the file itself gives."""
    target = repository / DEPENDENCIES / model.name
    shutil.rmtree(target, ignore_errors=True)
    log.info("model '%s': installing the archive's requirements.txt into %s", model.name, target)
    with tempfile.TemporaryDirectory(prefix="torchserve-requirements-") as folder:
        requirements = Path(folder) / "requirements.txt"
        with zipfile.ZipFile(model.archive) as mar:
            requirements.write_bytes(mar.read("requirements.txt"))
        command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
        command += ["--target", str(target), "-r", str(requirements)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=folder, check=False)
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise ConfigError(
            f"model '{model.name}' ({model.url}): pip could not install its requirements.txt: {said}"
        )
    return target


#: `python -m pipeline.tools.model_store`: the archives' folders written into a repository.
ModelStoreSettings = process_settings("ModelStoreSettings", (LauncherModelStore, Repository))


def main(argv: list[str] | None = None) -> int:
    """Write the archives' folders into `--model-dir`; 2 where the store or the configuration is wrong."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.tools.model_store",
        description="Write the folders of a TorchServe model store's archives into a model repository.",
    )
    add_arguments(parser, ModelStoreSettings)
    settings = ModelStoreSettings.parse(parser, argv)
    store, repository = settings.group(LauncherModelStore), settings.group(Repository).model_dir
    if store.model_store is None:
        parser.error("--model-store (env PIPELINE_MODEL_STORE) is required")
    try:
        archives = write_store_models(store, repository)
    except ConfigError as err:
        log.error("%s", err)
        return 2
    names = ", ".join(f"{a.name} ({a.url})" for a in archives) or "none"
    log.info("%s: archives served: %s", repository, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())

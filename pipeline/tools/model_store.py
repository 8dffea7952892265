"""`pipeline run --model-store DIR`: TorchServe's model store served as it is.

The archives `--models` names (TorchServe's flag: `all`, or `name=file.mar` / `file.mar` items; none by
default, as TorchServe loads none) become the folders of a model repository that the launcher makes for the
run (`pipeline.runtime.torchserve_store`), with the settings TorchServe's `config.properties` gives them
(`--ts-config`: its `models` JSON, `default_workers_per_model`, and `load_models` where `--models` is not
given). Every service serves that repository; the router answers TorchServe's APIs on its HTTP port and
registers further archives of the store into it.

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
import sys
import tempfile
from pathlib import Path
from typing import Annotated

from pipeline.protocol.errors import ConfigError, PipelineError
from pipeline.runtime.router_settings import TorchServeStore
from pipeline.runtime.service_settings import Repository
from pipeline.runtime.settings_cli import add_arguments, option, process_settings
from pipeline.runtime.torchserve_store import (
    ArchiveModel,
    archive_models,
    read_properties,
    remove_model,
    startup_models,
    write_model,
)

log = logging.getLogger(__name__)


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


def model_store_repository(args: argparse.Namespace) -> Path | None:
    """The repository of the run's archives (a new folder the caller removes), None without --model-store;
    `ConfigError` naming what is wrong with the store, the archives or the configuration."""
    if getattr(args, "model_store", None) is None:
        return None
    repository = Path(tempfile.mkdtemp(prefix="pipeline-model-store-"))
    write_store_models(args, repository)
    return repository


def write_store_models(args: argparse.Namespace, repository: Path) -> list[ArchiveModel]:
    """Write the folders of the archives `args` names (`--models`, else config.properties' `load_models`)
    into `repository`, and remove the folders of archives it no longer names; `ConfigError` naming what is
    wrong with the store, the archives or the configuration (then nothing is written)."""
    store: Path = args.model_store
    if not store.is_dir():
        raise ConfigError(f"--model-store {store}: no such folder")
    properties = read_properties(args.ts_config) if getattr(args, "ts_config", None) else {}
    models = getattr(args, "models", None) or properties.get("load_models", "")
    try:
        archives = startup_models(store, models, properties)
    except (PipelineError, ValueError) as exc:
        raise ConfigError(f"--model-store {store}: {getattr(exc, 'message', exc)}") from None
    named = {archive.name for archive in archives}
    for stale in archive_models(repository):
        if stale.name not in named:
            remove_model(repository, stale.name)
    for archive in archives:
        write_model(repository, archive)
    return archives


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
    args = parser.parse_args(argv)
    if args.model_store is None:
        parser.error("--model-store (env PIPELINE_MODEL_STORE) is required")
    try:
        archives = write_store_models(args, args.model_dir)
    except ConfigError as err:
        log.error("%s", err)
        return 2
    names = ", ".join(f"{a.name} ({a.url})" for a in archives) or "none"
    log.info("%s: archives served: %s", args.model_dir, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())

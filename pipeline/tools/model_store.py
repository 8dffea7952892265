"""`pipeline run --model-store DIR`: TorchServe's model store served as it is.

The archives `--models` names (TorchServe's flag: `all`, or `name=file.mar` / `file.mar` items; none by
default, as TorchServe loads none) become the folders of a model repository that the launcher makes for the
run (`pipeline.runtime.torchserve_store`), with the settings TorchServe's `config.properties` gives them
(`--ts-config`: its `models` JSON, `default_workers_per_model`, and `load_models` where `--models` is not
given). Every service serves that repository; the router answers TorchServe's APIs on its HTTP port and
registers further archives of the store into it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Annotated

from pipeline.protocol.errors import ConfigError, PipelineError
from pipeline.runtime.settings import TorchServeStore
from pipeline.runtime.settings_cli import option
from pipeline.runtime.torchserve_store import read_properties, startup_models, write_model


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
    store: Path | None = getattr(args, "model_store", None)
    if store is None:
        return None
    if not store.is_dir():
        raise ConfigError(f"--model-store {store}: no such folder")
    properties = read_properties(args.ts_config) if getattr(args, "ts_config", None) else {}
    models = getattr(args, "models", None) or properties.get("load_models", "")
    try:
        archives = startup_models(store, models, properties)
    except (PipelineError, ValueError) as exc:
        raise ConfigError(f"--model-store {store}: {getattr(exc, 'message', exc)}") from None
    repository = Path(tempfile.mkdtemp(prefix="pipeline-model-store-"))
    for archive in archives:
        write_model(repository, archive)
    return repository

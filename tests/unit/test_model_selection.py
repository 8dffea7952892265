"""`--load-model` as Triton's explicit model control reads it: a named ensemble with the models its steps call,
`*` for everything; what `pipeline run` gives each stage and the router of it, and Triton's boolean syntax."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pipeline.ensemble.catalog import ensemble_plans
from pipeline.ensemble.selection import selection
from pipeline.router.main import add_router_arguments, router_catalog
from pipeline.runtime import settings_values
from pipeline.runtime.router_settings import RouterSettings
from pipeline.runtime.server_settings import Logging
from pipeline.runtime.service_settings import Loading, stage_settings
from pipeline.runtime.settings_cli import ProcessSettings
from pipeline.stage.service import python_service_parser, repository_models
from pipeline.tools.launcher_settings import LauncherSettings
from pipeline.tools.model_selection import load_model_flags, stage_models, unknown_names
from tests.unit.test_settings import parse

TREE = Path(__file__).resolve().parents[2] / "model_repository"
#: No YAML folder beside the repository's own ensembles.
NO_FOLDER = TREE / "no-such-folder"


def test_a_named_ensemble_selects_the_models_its_steps_call():
    plans = {plan.name: plan for plan in ensemble_plans(repository=TREE)}
    assert selection(["digits"], plans) == (
        {"digits"},
        {"digits_preprocess", "digits_cnn", "digits_postprocess"},
    )
    assert selection(["digits_cnn", "refcnn_cnn"], plans) == (set(), {"digits_cnn", "refcnn_cnn"})


def test_each_stage_is_given_the_selected_models_that_run_there():
    assert stage_models(["digits"], TREE, NO_FOLDER) == {
        "model": ["digits_cnn"],
        "preprocess": ["digits_preprocess"],
        "postprocess": ["digits_postprocess"],
    }
    assert stage_models(["digits_cnn"], TREE, NO_FOLDER) == {
        "model": ["digits_cnn"],
        "preprocess": [],
        "postprocess": [],
    }
    assert stage_models(["*"], TREE, NO_FOLDER) is None and stage_models([], TREE, NO_FOLDER) is None
    assert unknown_names(["digits", "nope", "refcnn_cnn"], TREE, NO_FOLDER) == ["nope"]
    # A stage that runs none of them is told so: a blank --load-model alone loads none.
    assert load_model_flags([]) == ["--load-model="]

    def named(argv: list[str]) -> list[str] | None:
        settings = stage_settings("preprocess").parse(python_service_parser("preprocess"), argv)
        return repository_models(settings.group(Loading))

    assert named(load_model_flags([])) == []
    assert named(["--load-model=*"]) is None
    assert named(["--load-model=a", "--load-model=b"]) == ["a", "b"]


def router_args(argv: list[str]) -> ProcessSettings:
    parser = argparse.ArgumentParser(prog="router")
    add_router_arguments(parser)
    return RouterSettings.parse(parser, ["--model-dir", str(TREE), "--ensembles", str(NO_FOLDER), *argv])


def test_the_router_serves_the_ensembles_load_model_selects(tmp_path):
    assert set(router_catalog(router_args(["--load-model=digits"])).ensembles) == {"digits"}
    assert not router_catalog(router_args(["--load-model=digits_cnn"])).ensembles
    every = set(router_catalog(router_args([])).ensembles)
    assert {"digits", "refcnn", "embeddings"} <= every
    assert set(router_catalog(router_args(["--load-model=*"])).ensembles) == every
    # A broken ensemble that is not selected does not stop a router that exits on errors.
    (tmp_path / "broken.yaml").write_text("inputs: [")
    args = router_args(["--ensembles", str(tmp_path), "--load-model=digits"])
    assert args.exit_on_error and set(router_catalog(args).ensembles) == {"digits"}


@pytest.mark.parametrize(("text", "value"), [("true", True), ("FALSE", False), ("1", True), ("0", False)])
def test_booleans_take_tritons_syntax(text, value):
    args = parse(LauncherSettings, [f"--exit-on-error={text}", f"--strict-readiness={text}"])
    assert args.exit_on_error is value and args.strict_readiness is value
    assert settings_values.boolean(text) is value


def test_log_verbose_logs_at_debug_level():
    assert parse(LauncherSettings, ["--log-verbose=1", "--log-level=WARNING"]).group(Logging).level == "DEBUG"
    assert parse(LauncherSettings, ["--log-level=WARNING"]).group(Logging).level == "WARNING"

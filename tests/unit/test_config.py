"""Ensemble YAML: schema and graph validation, compilation into a plan, directories, and stage signatures."""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ensemble.catalog import (
    ensemble_files,
    load_catalog,
    load_ensemble,
    load_ensembles,
)
from pipeline.ensemble.compiler import compile_ensemble
from pipeline.ensemble.pbtxt import ensemble_config
from pipeline.ensemble.plan import EnsemblePlan, ModelSignature
from pipeline.ensemble.schema import DynamicBatchingConfig
from pipeline.ensemble.signatures import check_signatures
from pipeline.protocol.errors import ConfigError
from pipeline.protocol.types import BatchingConfig, TensorSpec

REPO = Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "stages": {
        "pre": {"address": "127.0.0.1:8101"},
        "model": {"address": "127.0.0.1:8102"},
        "post": {"address": "127.0.0.1:8103"},
    },
    "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [-1, 1]}],
    "outputs": [
        {"name": "LABEL", "datatype": "INT64", "shape": [-1, 1]},
        {"name": "SCORES", "datatype": "FP32", "shape": [-1, 10]},
    ],
    "steps": [
        {
            "model_name": "digits_pre",
            "stage": "pre",
            "input_map": {"IMAGE": "IMAGE"},
            "output_map": {"PIXELS": "pixels"},
        },
        {
            "model_name": "digits_cnn",
            "stage": "model",
            "input_map": {"INPUT": "pixels"},
            "output_map": {"LOGITS": "logits"},
        },
        {
            "model_name": "digits_post",
            "stage": "post",
            "input_map": {"LOGITS": "logits"},
            "output_map": {"LABEL": "LABEL", "SCORES": "SCORES"},
        },
    ],
}


def base() -> dict[str, Any]:
    return copy.deepcopy(BASE)


def write(directory: Path, data: Any, name: str = "ens.yaml") -> Path:
    path = directory / name
    path.write_text(
        data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False), encoding="utf-8"
    )
    return path


def error(tmp_path: Path, data: Any, *, name: str = "ens.yaml", environ: dict[str, str] | None = None) -> str:
    """Load data that must be rejected; return the message, which always names the file."""
    path = write(tmp_path, data, name)
    with pytest.raises(ConfigError) as info:
        load_ensemble(path, environ=environ or {})
    message = str(info.value)
    assert str(path) in message
    return message


def load(tmp_path: Path, data: Any, environ: dict[str, str] | None = None) -> EnsemblePlan:
    return load_ensemble(write(tmp_path, data), environ=environ or {})


# ------------------------------------------------------------------------------------------------------------
# A valid ensemble


def test_digits_example_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PREPROCESS_ADDRESS", "MODEL_ADDRESS", "POSTPROCESS_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MODEL_ADDRESS", "model:9000")
    plan = load_ensemble(REPO / "model_repository" / "digits" / "ensemble.yaml")
    assert plan.name == "digits"
    assert plan.max_batch_size == 64
    assert [s.model_name for s in plan.steps] == ["digits_preprocess", "digits_cnn", "digits_postprocess"]
    assert [s.depends_on for s in plan.steps] == [(), (0,), (1,)]
    assert {k: e.address for k, e in plan.stages.items()} == {
        "preprocess": "127.0.0.1:8101",
        "model": "model:9000",
        "postprocess": "127.0.0.1:8103",
    }
    assert plan.outputs == (TensorSpec("LABEL", "INT64", (-1, 1)), TensorSpec("SCORES", "FP32", (-1, 10)))


def test_plan_fields(tmp_path: Path) -> None:
    data = base()
    data["steps"][1]["model_version"] = 3
    plan = load(tmp_path, data)
    assert plan.name == "ens"  # the file's stem
    assert plan.source == str(tmp_path / "ens.yaml")
    assert plan.inputs == (TensorSpec("IMAGE", "BYTES", (-1, 1)),)
    pre, cnn, post = plan.steps
    assert (pre.model_version, cnn.model_version) == ("", "3")
    assert cnn.label == "step 1 (digits_cnn)"
    assert cnn.stage == "model"
    assert cnn.inputs == (("INPUT", "pixels"),)
    assert post.outputs == (("LABEL", "LABEL"), ("SCORES", "SCORES"))
    with pytest.raises(TypeError):
        plan.stages["x"] = plan.stages["pre"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.name = "other"  # type: ignore[misc]


def test_name_and_string_version(tmp_path: Path) -> None:
    data = base()
    data["name"] = "custom"
    data["steps"][0]["model_version"] = "2"
    data["steps"][1]["model_version"] = "-1"
    plan = load(tmp_path, data)
    assert plan.name == "custom"
    assert (plan.steps[0].model_version, plan.steps[1].model_version) == ("2", "")


def test_a_string_version_gives_the_ensemble_a_model_config(tmp_path: Path) -> None:
    """Triton's `ensemble_scheduling.step.model_version` is an int64: a numeric string maps onto it (it
    used to fail with INTERNAL when a client asked for the ensemble's ModelConfig)."""
    data = base()
    data["steps"][1]["model_version"] = "3"
    config = ensemble_config(load(tmp_path, data))
    assert [step.model_version for step in config.ensemble_scheduling.step] == [-1, 3, -1]


@pytest.mark.parametrize("version", ["v2", "latest", "1.5", "0", "-2", " ", "²", "99999999999999999999"])
def test_a_non_numeric_string_version_is_refused_naming_the_file_and_step(
    tmp_path: Path, version: str
) -> None:
    data = base()
    data["steps"][1]["model_version"] = version
    message = error(tmp_path, data)
    assert "step 1 (digits_cnn): steps[1].model_version" in message
    assert repr(version) in message or "too large" in message


def test_non_batching_ensemble_needs_no_batch_dimension(tmp_path: Path) -> None:
    data = base()
    data["max_batch_size"] = 0
    data["inputs"][0]["shape"] = [1]
    data["outputs"][1]["shape"] = []
    plan = load(tmp_path, data)
    assert plan.max_batch_size == 0
    assert plan.inputs[0].shape == (1,)


def test_unconsumed_step_output_is_allowed_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = base()
    data["steps"][1]["output_map"]["FEATURES"] = "features"
    with caplog.at_level(logging.INFO, logger="pipeline.ensemble.compiler"):
        plan = load(tmp_path, data)
    assert ("FEATURES", "features") in plan.steps[1].outputs
    assert "step 1 (digits_cnn) output 'FEATURES'" in caplog.text
    assert "'features' is not used" in caplog.text


def test_dynamic_batching_in_yaml_has_the_routers_knobs_and_defaults(tmp_path: Path) -> None:
    """The YAML's `dynamic_batching` spells every knob of `BatchingConfig` and no other, and what a file
    leaves out takes `BatchingConfig`'s default: the defaults have one home."""
    assert set(DynamicBatchingConfig.model_fields) == {f.name for f in dataclasses.fields(BatchingConfig)}
    data = base()
    data["stages"]["model"]["dynamic_batching"] = {}
    plan = load(tmp_path, data)
    assert plan.steps[1].batching == BatchingConfig()


# ------------------------------------------------------------------------------------------------------------
# YAML and schema errors


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    message = error(tmp_path, "name: x\nsteps: [\n  - a: b\n  c: d\n")
    assert "invalid YAML" in message
    assert re.search(r"line \d+", message)


def test_duplicate_yaml_key_is_rejected(tmp_path: Path) -> None:
    message = error(tmp_path, "name: a\nname: b\n")
    assert "duplicate key 'name'" in message
    assert "line 2" in message


@pytest.mark.parametrize(
    ("text", "found"), [("- a\n- b\n", "a list"), ("just text\n", "a string"), ("", "empty")]
)
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, found: str) -> None:
    message = error(tmp_path, text)
    assert "mapping" in message
    assert found in message


def test_unknown_top_level_key(tmp_path: Path) -> None:
    data = base()
    data["dynamic_batching"] = {}
    message = error(tmp_path, data)
    assert "top level: unknown key 'dynamic_batching'" in message
    assert "allowed: name, max_batch_size" in message


def test_unknown_key_in_step(tmp_path: Path) -> None:
    data = base()
    data["steps"][1]["input_maps"] = {"INPUT": "pixels"}
    message = error(tmp_path, data)
    assert "step 1 (digits_cnn): steps[1]: unknown key 'input_maps'" in message
    assert "input_map" in message


def test_unknown_key_in_tensor_and_stage(tmp_path: Path) -> None:
    data = base()
    data["outputs"][1]["dims"] = [10]
    data["stages"]["model"]["port"] = 1
    message = error(tmp_path, data)
    assert "output 'SCORES': outputs[1]: unknown key 'dims'" in message
    assert "stages.model: unknown key 'port'" in message


def test_missing_required_keys(tmp_path: Path) -> None:
    data = base()
    del data["steps"][2]["output_map"]
    del data["inputs"]
    message = error(tmp_path, data)
    assert "step 2 (digits_post): steps[2]: missing required key 'output_map'" in message
    assert "top level: missing required key 'inputs'" in message


def test_bad_datatype_names_the_tensor(tmp_path: Path) -> None:
    data = base()
    data["outputs"][1]["datatype"] = "TYPE_FP32"
    message = error(tmp_path, data)
    assert "output 'SCORES': outputs[1].datatype: unknown datatype 'TYPE_FP32'" in message
    assert "write 'FP32'" in message


@pytest.mark.parametrize(
    ("shape", "words"), [([-1, -2], "dimension 1 is -2"), ([-1, "3"], "must be an integer")]
)
def test_bad_dims(tmp_path: Path, shape: list[Any], words: str) -> None:
    data = base()
    data["inputs"][0]["shape"] = shape
    message = error(tmp_path, data)
    assert "input 'IMAGE': inputs[0].shape" in message
    assert words in message


def test_batching_ensemble_shapes_start_with_batch_dimension(tmp_path: Path) -> None:
    data = base()
    data["outputs"][1]["shape"] = [10]
    message = error(tmp_path, data)
    assert "ensemble output 'SCORES'" in message
    assert "must start with -1" in message


def test_wrong_value_type_is_said_in_yaml_words(tmp_path: Path) -> None:
    data = base()
    data["steps"][1]["input_map"] = ["INPUT", "pixels"]
    message = error(tmp_path, data)
    assert "step 1 (digits_cnn): steps[1].input_map: must be a mapping, found a list" in message
    assert "validation error" not in message  # not pydantic's raw dump


@pytest.mark.parametrize("version", [0, -2, "", 1.5, True])
def test_bad_model_version(tmp_path: Path, version: Any) -> None:
    data = base()
    data["steps"][1]["model_version"] = version
    assert "step 1 (digits_cnn): steps[1].model_version" in error(tmp_path, data)


# ------------------------------------------------------------------------------------------------------------
# Graph errors


def test_undeclared_stage(tmp_path: Path) -> None:
    data = base()
    data["steps"][1]["stage"] = "gpu"
    message = error(tmp_path, data)
    assert "step 1 (digits_cnn): stage 'gpu' is not declared under 'stages'" in message


def test_consumed_tensor_nobody_produces(tmp_path: Path) -> None:
    data = base()
    data["steps"][1]["input_map"] = {"INPUT": "pixel"}
    message = error(tmp_path, data)
    assert "step 1 (digits_cnn): input 'INPUT' ← tensor 'pixel': nothing produces 'pixel'" in message
    assert "did you mean 'pixels'" in message


def test_two_steps_produce_one_tensor(tmp_path: Path) -> None:
    data = base()
    data["steps"][2]["output_map"]["PROBS"] = "logits"
    message = error(tmp_path, data)
    assert "step 2 (digits_post): output 'PROBS' → tensor 'logits'" in message
    assert "already produced by step 1 (digits_cnn) output 'LOGITS'" in message


def test_one_step_maps_two_outputs_to_one_tensor(tmp_path: Path) -> None:
    data = base()
    data["steps"][2]["output_map"]["SCORES"] = "LABEL"
    data["outputs"].pop()
    message = error(tmp_path, data)
    assert "step 2 (digits_post): output 'SCORES' → tensor 'LABEL'" in message
    assert "already produced by step 2 (digits_post) output 'LABEL'" in message


def test_step_output_shadows_ensemble_input(tmp_path: Path) -> None:
    data = base()
    data["steps"][1]["output_map"]["ECHO"] = "IMAGE"
    message = error(tmp_path, data)
    assert "step 1 (digits_cnn): output 'ECHO' → tensor 'IMAGE'" in message
    assert "is an ensemble input" in message


def test_ensemble_output_nothing_produces(tmp_path: Path) -> None:
    data = base()
    data["outputs"].append({"name": "TOP5", "datatype": "INT64", "shape": [-1, 5]})
    message = error(tmp_path, data)
    assert "ensemble output 'TOP5': no step produces it" in message


def test_cycle_names_the_steps(tmp_path: Path) -> None:
    data = base()
    data["steps"][0]["input_map"]["HINT"] = "logits"
    message = error(tmp_path, data)
    assert "cycle" in message
    assert "step 0 (digits_pre) → 'pixels' → step 1 (digits_cnn) → 'logits' → step 0 (digits_pre)" in message
    assert "digits_post" not in message  # downstream of the cycle, not part of it


def test_step_consuming_its_own_output_is_a_cycle(tmp_path: Path) -> None:
    data = base()
    data["steps"][1]["input_map"]["STATE"] = "logits"
    message = error(tmp_path, data)
    assert "step 1 (digits_cnn) consumes its own output" in message
    assert "cycle" in message


def test_empty_steps(tmp_path: Path) -> None:
    data = base()
    data["steps"] = []
    assert "steps: there are no steps" in error(tmp_path, data)


@pytest.mark.parametrize("kind", ["inputs", "outputs"])
def test_duplicate_tensor_names(tmp_path: Path, kind: str) -> None:
    data = base()
    data[kind].append(copy.deepcopy(data[kind][0]))
    name = data[kind][0]["name"]
    message = error(tmp_path, data)
    assert f"ensemble {kind[:-1]} '{name}'" in message
    assert "declared twice" in message


def test_tensor_both_input_and_output(tmp_path: Path) -> None:
    data = base()
    data["outputs"].append(copy.deepcopy(data["inputs"][0]))
    assert "tensor 'IMAGE' is both an ensemble input and an ensemble output" in error(tmp_path, data)


@pytest.mark.parametrize("key", ["input_map", "output_map"])
def test_empty_map(tmp_path: Path, key: str) -> None:
    data = base()
    data["steps"][0][key] = {}
    assert f"step 0 (digits_pre): {key} is empty" in error(tmp_path, data)


def test_ensemble_named_like_its_own_step_model(tmp_path: Path) -> None:
    data = base()
    data["name"] = "digits_cnn"
    assert "step 1 (digits_cnn): model_name 'digits_cnn' is the ensemble's own name" in error(tmp_path, data)


def test_all_graph_errors_are_reported_at_once(tmp_path: Path) -> None:
    data = base()
    data["steps"][1]["stage"] = "gpu"
    data["steps"][2]["input_map"] = {"LOGITS": "logit"}
    message = error(tmp_path, data)
    assert "stage 'gpu'" in message
    assert "tensor 'logit'" in message


# ------------------------------------------------------------------------------------------------------------
# Environment expansion in addresses


def test_env_expansion(tmp_path: Path) -> None:
    data = base()
    data["stages"]["pre"]["address"] = "${PRE_HOST}:${PRE_PORT:-8101}"
    data["stages"]["model"]["address"] = "${MODEL_ADDRESS:-127.0.0.1:9}"
    data["stages"]["post"]["address"] = "${POST_ADDRESS:-[::1]:8103}"
    plan = load(
        tmp_path, data, environ={"PRE_HOST": "pre.local", "MODEL_ADDRESS": "", "POST_ADDRESS": "unix:/s"}
    )
    assert plan.stages["pre"].address == "pre.local:8101"
    assert plan.stages["model"].address == "127.0.0.1:9"  # empty counts as unset, as in the shell
    assert plan.stages["post"].address == "unix:/s"


def test_env_expansion_ipv6_default(tmp_path: Path) -> None:
    data = base()
    data["stages"]["post"]["address"] = "${POST_ADDRESS:-[::1]:8103}"
    assert load(tmp_path, data).stages["post"].address == "[::1]:8103"


def test_missing_env_var_names_file_and_variable(tmp_path: Path) -> None:
    data = base()
    data["stages"]["model"]["address"] = "${MODEL_ADDRESS}"
    message = error(tmp_path, data)
    assert "stages.model.address" in message
    assert "environment variable 'MODEL_ADDRESS' is not set" in message


@pytest.mark.parametrize("address", ["${MODEL", "${1X}:80", "localhost", "host:99999", "a b:80"])
def test_bad_address(tmp_path: Path, address: str) -> None:
    data = base()
    data["stages"]["model"]["address"] = address
    assert "stages.model.address" in error(tmp_path, data)


def test_os_environ_is_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_TEST_MODEL_ADDRESS", "10.0.0.2:7000")
    data = base()
    data["stages"]["model"]["address"] = "${PIPELINE_TEST_MODEL_ADDRESS}"
    assert load_ensemble(write(tmp_path, data)).stages["model"].address == "10.0.0.2:7000"


# ------------------------------------------------------------------------------------------------------------
# Order and dependencies


def _step(name: str, inputs: dict[str, str], outputs: dict[str, str]) -> dict[str, Any]:
    return {"model_name": name, "stage": "model", "input_map": inputs, "output_map": outputs}


def test_steps_in_topological_order_keep_yaml_index(tmp_path: Path) -> None:
    data = base()
    data["steps"].reverse()
    plan = load(tmp_path, data)
    assert [(s.index, s.model_name) for s in plan.steps] == [
        (2, "digits_pre"),
        (1, "digits_cnn"),
        (0, "digits_post"),
    ]
    assert [s.depends_on for s in plan.steps] == [(), (2,), (1,)]


def test_diamond_fan_out_and_fan_in(tmp_path: Path) -> None:
    data = base()
    data["outputs"] = [{"name": "OUT", "datatype": "FP32", "shape": [-1]}]
    data["steps"] = [
        _step("d", {"L": "b", "R": "c"}, {"Y": "OUT"}),
        _step("c", {"X": "a"}, {"Y": "c"}),
        _step("b", {"X": "a"}, {"Y": "b"}),
        _step("a", {"X": "IMAGE"}, {"Y": "a"}),
    ]
    plan = load(tmp_path, data)
    # Ties (b and c are both ready after a) keep the YAML order: c (index 1) before b (index 2).
    assert [s.model_name for s in plan.steps] == ["a", "c", "b", "d"]
    deps = {s.model_name: s.depends_on for s in plan.steps}
    assert deps == {"a": (), "b": (3,), "c": (3,), "d": (1, 2)}


def test_independent_steps_keep_yaml_order(tmp_path: Path) -> None:
    data = base()
    data["outputs"] = [
        {"name": "P", "datatype": "FP32", "shape": [-1]},
        {"name": "Q", "datatype": "FP32", "shape": [-1]},
    ]
    data["steps"] = [_step("q", {"X": "IMAGE"}, {"Y": "Q"}), _step("p", {"X": "IMAGE"}, {"Y": "P"})]
    plan = load(tmp_path, data)
    assert [s.index for s in plan.steps] == [0, 1]
    assert all(s.depends_on == () for s in plan.steps)


# ------------------------------------------------------------------------------------------------------------
# Directories and cross-file checks


def _named(name: str, models: tuple[str, str, str] = ("pre", "cnn", "post")) -> dict[str, Any]:
    data = base()
    data["name"] = name
    for step, model in zip(data["steps"], models, strict=True):
        step["model_name"] = f"{name}_{model}"
    return data


def test_directory_loads_yaml_and_yml_sorted(tmp_path: Path) -> None:
    write(tmp_path, _named("b"), "b.yml")
    write(tmp_path, _named("a"), "a.yaml")
    write(tmp_path, "not: an ensemble", "notes.txt")
    catalog = load_ensembles(tmp_path, environ={})
    assert list(catalog.ensembles) == ["a", "b"]
    assert catalog.ensembles["b"].source == str(tmp_path / "b.yml")
    assert set(catalog.stages) == {"pre", "model", "post"}
    assert catalog.stage_models()["b_cnn"] == "model"
    with pytest.raises(TypeError):
        catalog.ensembles["c"] = catalog.ensembles["a"]  # type: ignore[index]


def test_list_of_files(tmp_path: Path) -> None:
    first = write(tmp_path, _named("a"), "a.yaml")
    second = write(tmp_path, _named("b"), "b.yaml")
    assert list(load_ensembles([second, first], environ={}).ensembles) == ["b", "a"]


def test_an_empty_or_missing_folder_holds_no_ensemble(tmp_path: Path) -> None:
    assert ensemble_files([tmp_path, tmp_path / "missing"]) == []
    with pytest.raises(ConfigError, match=re.escape(f"no ensemble files in {tmp_path}")):
        load_ensembles(tmp_path)
    # The router's catalog: the folder is optional, stages given by key serve on.
    catalog = load_catalog([tmp_path, tmp_path / "missing"], stages={"s": "127.0.0.1:9"}, environ={})
    assert dict(catalog.ensembles) == {} and list(catalog.stages) == ["s"]
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_catalog([tmp_path / "missing.yaml"], stages={"s": "127.0.0.1:9"}, environ={})


def test_yaml_ensembles_live_in_the_model_repository_named_by_their_folder(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    for folder in ("a", "b", "c", "d", "notes"):
        (repository / folder).mkdir(parents=True)
    (tmp_path / "ensembles").mkdir()
    write(repository / "a", _named("a"), "ensemble.yaml")
    write(repository / "b", {k: v for k, v in _named("x").items() if k != "name"}, "ensemble.yaml")
    # "notes" holds no ensemble.yaml: no ensemble of the router's
    catalog = load_catalog([tmp_path / "ensembles"], repository=repository, environ={})
    assert sorted(catalog.ensembles) == ["a", "b"]  # b's name is its folder's
    assert catalog.ensembles["a"].source == str(repository / "a" / "ensemble.yaml")

    write(repository / "c", _named("other"), "ensemble.yaml")
    with pytest.raises(ConfigError, match="name 'other' differs from its folder's name 'c'"):
        load_catalog(repository=repository, environ={})
    (repository / "c" / "ensemble.yaml").unlink()

    write(repository / "d", _named("d"), "ensemble.yaml")
    (repository / "d" / "config.pbtxt").write_text('backend: "python"\n')
    with pytest.raises(ConfigError, match=re.escape("its folder also holds a config.pbtxt")):
        load_catalog(repository=repository, environ={})
    (repository / "d" / "config.pbtxt").unlink()

    # One more of the same name in the ensembles folder is an error, as two files of one name are.
    write(tmp_path / "ensembles", _named("a"), "a.yaml")
    with pytest.raises(ConfigError, match="ensemble names must be unique"):
        load_catalog([tmp_path / "ensembles"], repository=repository, environ={})


def test_error_in_one_file_names_that_file(tmp_path: Path) -> None:
    write(tmp_path, _named("a"), "a.yaml")
    bad = _named("b")
    bad["steps"][0]["stage"] = "nowhere"
    write(tmp_path, bad, "b.yaml")
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "b.yaml"))):
        load_ensembles(tmp_path, environ={})


def test_duplicate_ensemble_names_across_files(tmp_path: Path) -> None:
    write(tmp_path, _named("same"), "a.yaml")
    write(tmp_path, _named("same", ("x", "y", "z")), "b.yaml")
    with pytest.raises(ConfigError) as info:
        load_ensembles(tmp_path, environ={})
    message = str(info.value)
    assert "ensemble 'same'" in message
    assert str(tmp_path / "a.yaml") in message
    assert str(tmp_path / "b.yaml") in message


def test_stage_with_two_addresses_across_files(tmp_path: Path) -> None:
    write(tmp_path, _named("a"), "a.yaml")
    other = _named("b")
    other["stages"]["model"]["address"] = "gpu-box:8102"
    write(tmp_path, other, "b.yaml")
    with pytest.raises(ConfigError) as info:
        load_ensembles(tmp_path, environ={})
    message = str(info.value)
    assert "stage 'model'" in message
    assert "'gpu-box:8102'" in message
    assert "'127.0.0.1:8102'" in message
    assert str(tmp_path / "a.yaml") in message
    assert str(tmp_path / "b.yaml") in message


def test_ensemble_named_like_a_model_of_another_file(tmp_path: Path) -> None:
    write(tmp_path, _named("a"), "a.yaml")
    write(tmp_path, _named("a_cnn", ("p", "q", "r")), "b.yaml")
    with pytest.raises(ConfigError) as info:
        load_ensembles(tmp_path, environ={})
    message = str(info.value)
    assert "ensemble name 'a_cnn' is also a stage model name" in message
    assert str(tmp_path / "a.yaml") in message
    assert str(tmp_path / "b.yaml") in message


def test_model_served_by_two_stages(tmp_path: Path) -> None:
    write(tmp_path, _named("a"), "a.yaml")
    other = _named("b")
    other["steps"][1]["model_name"] = "a_cnn"
    other["steps"][1]["stage"] = "post"
    write(tmp_path, other, "b.yaml")
    with pytest.raises(ConfigError) as info:
        load_ensembles(tmp_path, environ={})
    message = str(info.value)
    assert "step 1 (a_cnn): model 'a_cnn' is served by stage 'post'" in message
    assert str(tmp_path / "a.yaml") in message


# ------------------------------------------------------------------------------------------------------------
# Stage signatures


def signatures() -> dict[str, ModelSignature]:
    return {
        "digits_pre": ModelSignature(
            "digits_pre",
            (TensorSpec("IMAGE", "BYTES", (-1, 1)),),
            (TensorSpec("PIXELS", "FP32", (-1, 1, 8, 8)),),
            64,
        ),
        "digits_cnn": ModelSignature(
            "digits_cnn",
            (TensorSpec("INPUT", "FP32", (-1, 1, 8, 8)),),
            (TensorSpec("LOGITS", "FP32", (-1, 10)),),
            64,
        ),
        "digits_post": ModelSignature(
            "digits_post",
            (TensorSpec("LOGITS", "FP32", (-1, -1)),),
            (TensorSpec("LABEL", "INT64", (-1, 1)), TensorSpec("SCORES", "FP32", (-1, 10))),
            64,
        ),
    }


def replace(sigs: dict[str, ModelSignature], model: str, **changes: Any) -> dict[str, ModelSignature]:
    sigs[model] = dataclasses.replace(sigs[model], **changes)
    return sigs


def check_error(tmp_path: Path, sigs: dict[str, ModelSignature], data: dict[str, Any] | None = None) -> str:
    plan = load(tmp_path, data or base())
    with pytest.raises(ConfigError) as info:
        check_signatures(plan, sigs)
    message = str(info.value)
    assert plan.source in message
    return message


def test_signatures_match(tmp_path: Path) -> None:
    check_signatures(load(tmp_path, base()), signatures())


def test_signature_of_unknown_model(tmp_path: Path) -> None:
    sigs = signatures()
    del sigs["digits_cnn"]
    message = check_error(tmp_path, sigs)
    assert "step 1 (digits_cnn): model 'digits_cnn' is unknown to stage 'model' (127.0.0.1:8102)" in message


def test_input_map_key_not_an_input_of_the_model(tmp_path: Path) -> None:
    sigs = replace(signatures(), "digits_cnn", inputs=(TensorSpec("X", "FP32", (-1, 1, 8, 8)),))
    message = check_error(tmp_path, sigs)
    assert "step 1 (digits_cnn): input_map maps 'INPUT' ← tensor 'pixels'" in message
    assert "no input 'INPUT' (its inputs: X)" in message
    assert "stage input 'X' (FP32 [-1, 1, 8, 8]) is not mapped" in message


def test_required_input_not_mapped(tmp_path: Path) -> None:
    inputs = (*signatures()["digits_cnn"].inputs, TensorSpec("MASK", "BOOL", (-1, 1)))
    message = check_error(tmp_path, replace(signatures(), "digits_cnn", inputs=inputs))
    assert "step 1 (digits_cnn): stage input 'MASK' (BOOL [-1, 1]) is not mapped" in message


def test_thousands_of_unmapped_inputs_make_one_short_error(tmp_path: Path) -> None:
    extra = tuple(TensorSpec(f"IN_{i}", "FP32", (-1, 1)) for i in range(5000))
    inputs = (*signatures()["digits_cnn"].inputs, *extra)
    message = check_error(tmp_path, replace(signatures(), "digits_cnn", inputs=inputs))
    assert (
        "step 1 (digits_cnn): stage inputs IN_0, IN_1, IN_2, IN_3, IN_4, IN_5, IN_6, IN_7 and 4,992 more are "
        "not mapped; add them to input_map (mapped now: INPUT)"
    ) in message
    assert len(message) < 1000


def test_output_map_key_not_an_output_of_the_model(tmp_path: Path) -> None:
    sigs = replace(signatures(), "digits_post", outputs=(TensorSpec("LABEL", "INT64", (-1, 1)),))
    message = check_error(tmp_path, sigs)
    assert "step 2 (digits_post): output_map maps 'SCORES' → tensor 'SCORES'" in message
    assert "no output 'SCORES' (its outputs: LABEL)" in message


def test_datatype_mismatch_between_steps(tmp_path: Path) -> None:
    sigs = replace(signatures(), "digits_pre", outputs=(TensorSpec("PIXELS", "UINT8", (-1, 1, 8, 8)),))
    message = check_error(tmp_path, sigs)
    assert (
        "step 1 (digits_cnn): input 'INPUT' ← tensor 'pixels': datatype FP32 expected by the stage, "
        "but 'pixels' is UINT8 (produced by step 0 (digits_pre) output 'PIXELS')"
    ) in message


def test_datatype_mismatch_from_ensemble_input(tmp_path: Path) -> None:
    sigs = replace(signatures(), "digits_pre", inputs=(TensorSpec("IMAGE", "UINT8", (-1, 1)),))
    message = check_error(tmp_path, sigs)
    assert (
        "step 0 (digits_pre): input 'IMAGE' ← tensor 'IMAGE': datatype UINT8 expected by the stage" in message
    )
    assert "'IMAGE' is BYTES (an ensemble input)" in message


def test_datatype_mismatch_to_ensemble_output(tmp_path: Path) -> None:
    outputs = (TensorSpec("LABEL", "INT32", (-1, 1)), TensorSpec("SCORES", "FP32", (-1, 10)))
    message = check_error(tmp_path, replace(signatures(), "digits_post", outputs=outputs))
    assert "ensemble output 'LABEL': datatype INT64 declared by the ensemble, but 'LABEL' is INT32" in message
    assert "produced by step 2 (digits_post) output 'LABEL'" in message


def test_rank_mismatch(tmp_path: Path) -> None:
    sigs = replace(signatures(), "digits_cnn", inputs=(TensorSpec("INPUT", "FP32", (-1, 64)),))
    message = check_error(tmp_path, sigs)
    assert "step 1 (digits_cnn): input 'INPUT' ← tensor 'pixels': shape [-1, 64] (rank 2)" in message
    assert "has shape [-1, 1, 8, 8] (rank 4)" in message


def test_dimension_mismatch(tmp_path: Path) -> None:
    sigs = replace(signatures(), "digits_cnn", inputs=(TensorSpec("INPUT", "FP32", (-1, 1, 28, 28)),))
    message = check_error(tmp_path, sigs)
    assert "step 1 (digits_cnn): input 'INPUT' ← tensor 'pixels'" in message
    assert "(dimension 2: 28 vs 8)" in message


def test_variable_dimension_on_either_side_is_compatible(tmp_path: Path) -> None:
    sigs = replace(signatures(), "digits_cnn", inputs=(TensorSpec("INPUT", "FP32", (-1, 1, -1, 8)),))
    sigs = replace(sigs, "digits_pre", outputs=(TensorSpec("PIXELS", "FP32", (-1, -1, 8, 8)),))
    check_signatures(load(tmp_path, base()), sigs)


def test_batching_ensemble_needs_batching_stage_models(tmp_path: Path) -> None:
    message = check_error(tmp_path, replace(signatures(), "digits_cnn", max_batch_size=0))
    assert "step 1 (digits_cnn): the ensemble batches (max_batch_size 64)" in message


# ------------------------------------------------------------------------------------------------------------
# Random graphs


@st.composite
def random_dags(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    """A DAG in generation order: step i consumes -1 (the ensemble input) or outputs of steps < i.

    Returns each step's producers and a permutation that becomes the YAML order.
    """
    count = draw(st.integers(1, 8))
    producers = [sorted(draw(st.sets(st.integers(-1, i - 1), min_size=1, max_size=3))) for i in range(count)]
    order = draw(st.permutations(range(count)))
    return producers, list(order)


def _dag_ensemble(producers: list[list[int]], order: list[int]) -> dict[str, Any]:
    steps = [
        _step(f"m{i}", {f"I{p}": "IN" if p < 0 else f"t{p}" for p in producers[i]}, {"O": f"t{i}"})
        for i in order
    ]
    return {
        "stages": {"model": {"address": "localhost:1"}},
        "inputs": [{"name": "IN", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": f"t{len(producers) - 1}", "datatype": "FP32", "shape": [-1]}],
        "steps": steps,
    }


@settings(max_examples=150, deadline=None)
@given(random_dags())
def test_random_dags_compile_in_dependency_order(dag: tuple[list[list[int]], list[int]]) -> None:
    producers, order = dag
    plan = compile_ensemble(_dag_ensemble(producers, order), "random.yaml", default_name="random")
    position_of_model = {step.model_name: n for n, step in enumerate(plan.steps)}
    yaml_index_of_model = {f"m{i}": n for n, i in enumerate(order)}
    assert len(plan.steps) == len(producers)
    for step in plan.steps:
        generated = int(step.model_name[1:])
        expected = sorted(yaml_index_of_model[f"m{p}"] for p in producers[generated] if p >= 0)
        assert list(step.depends_on) == expected
        for p in producers[generated]:
            if p >= 0:
                assert position_of_model[f"m{p}"] < position_of_model[step.model_name]


@settings(max_examples=150, deadline=None)
@given(random_dags(), st.data())
def test_random_graphs_with_a_back_edge_are_cycles(
    dag: tuple[list[list[int]], list[int]], data: st.DataObject
) -> None:
    producers, order = dag
    # An edge from step j back into one of its ancestors (or itself) closes a loop.
    ancestors: list[set[int]] = []
    for i, deps in enumerate(producers):
        ancestors.append({i}.union(*(ancestors[p] for p in deps if p >= 0)))
    j = data.draw(st.integers(0, len(producers) - 1))
    target = data.draw(st.sampled_from(sorted(ancestors[j])))
    producers = copy.deepcopy(producers)
    producers[target].append(j)
    with pytest.raises(ConfigError, match="cycle") as info:
        compile_ensemble(_dag_ensemble(producers, order), "random.yaml", default_name="random")
    message = str(info.value)
    assert "random.yaml" in message
    labels = re.findall(r"step (\d+) \(m(\d+)\)", message)
    assert labels, message
    named = {int(generated) for _, generated in labels}
    # Every named step lies on a loop: it is an ancestor of `j` and `target` is an ancestor of it.
    for step in named:
        assert step in ancestors[j] and target in ancestors[step]

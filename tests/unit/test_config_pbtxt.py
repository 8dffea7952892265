"""Triton's ensemble definition (config.pbtxt) compiled as the YAML is, and the catalog of both front ends."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from google.protobuf import text_format

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.ensemble.catalog import build_catalog, declared_batching, load_catalog
from pipeline.ensemble.compiler import compile_ensemble
from pipeline.ensemble.pbtxt import load_repository_ensembles
from pipeline.protocol.errors import ConfigError
from pipeline.protocol.model_config import batching_of_config
from pipeline.protocol.types import BatchingConfig

REPO = Path(__file__).resolve().parents[2]

ENSEMBLE = """
name: "chain"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "TEXT", data_type: TYPE_STRING, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ -1, 4 ] }} ]
ensemble_scheduling {{
  step [
    {{
      model_name: "encode"
      model_version: -1
      input_map {{ key: "IN" value: "TEXT" }}
      output_map {{ key: "EMB" value: "{embedded}" }}
    }},
    {{
      model_name: "scale"
      input_map {{ key: "X" value: "{scale_input}" }}
      output_map {{ key: "Y" value: "{scale_output}" }}
    }}
  ]
}}
"""


def repository(
    root: Path, *, embedded: str = "emb", scale_input: str = "emb", scale_output: str = "OUT"
) -> Path:
    folder = root / "chain"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(
        ENSEMBLE.format(embedded=embedded, scale_input=scale_input, scale_output=scale_output)
    )
    return folder / "config.pbtxt"


def test_a_triton_ensemble_becomes_a_plan(tmp_path: Path) -> None:
    config = repository(tmp_path)
    (plan,) = load_repository_ensembles(tmp_path)
    assert plan.name == "chain" and plan.source == str(config) and plan.max_batch_size == 8
    # TYPE_STRING is BYTES on the wire; dims gain the batch dimension because max_batch_size > 0.
    assert [(s.name, s.datatype, s.shape) for s in plan.inputs] == [("TEXT", "BYTES", (-1, 1))]
    assert [(s.name, s.datatype, s.shape) for s in plan.outputs] == [("OUT", "FP32", (-1, -1, 4))]
    encode, scale = plan.steps
    assert (encode.model_name, encode.model_version, encode.stage) == ("encode", "", "")
    assert scale.model_version == "" and scale.depends_on == (0,)  # unset (0) is the default version
    assert encode.inputs == (("IN", "TEXT"),) and scale.outputs == (("Y", "OUT"),)
    # No batching set: the model's own dynamic_batching applies.
    assert all(step.batching is None and step.model_batching for step in plan.steps)


def test_the_example_in_the_tree_compiles() -> None:
    (plan,) = load_repository_ensembles(REPO / "examples" / "triton-ensemble")
    assert plan.name == "digits_triton"
    assert [s.model_name for s in plan.steps] == ["digits_preprocess", "digits_cnn", "digits_postprocess"]


@pytest.mark.parametrize(
    ("tensors", "words"),
    [
        (
            {"scale_input": "embedded"},
            ["step 1 (scale)", "input 'X' ← tensor 'embedded'", "nothing produces 'embedded'"],
        ),
        (
            {"scale_output": "TEXT"},
            ["step 1 (scale)", "output 'Y' → tensor 'TEXT'", "only one producer"],
        ),
        (
            {"embedded": "OUT"},
            ["step 1 (scale)", "'OUT' is already produced by step 0 (encode)"],
        ),
    ],
    ids=["missing-producer", "input-produced", "two-producers"],
)
def test_graph_errors_name_the_file_the_step_and_the_tensor(
    tmp_path: Path, tensors: dict[str, str], words: list[str]
) -> None:
    config = repository(tmp_path, **tensors)
    with pytest.raises(ConfigError) as info:
        load_repository_ensembles(tmp_path)
    message = str(info.value)
    assert str(config) in message
    for word in words:
        assert word in message, message


def test_a_cycle_is_spelled_out(tmp_path: Path) -> None:
    folder = tmp_path / "loop"
    folder.mkdir()
    (folder / "config.pbtxt").write_text(
        """
platform: "ensemble"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Z", data_type: TYPE_FP32, dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "a" input_map { key: "X" value: "X" } input_map { key: "B" value: "b" }
    output_map { key: "Y" value: "a" } },
  { model_name: "b" input_map { key: "X" value: "a" } output_map { key: "Y" value: "b" }
    output_map { key: "Z" value: "Z" } }
] }
"""
    )
    with pytest.raises(ConfigError) as info:
        load_repository_ensembles(tmp_path)
    assert "the steps form a cycle: step 0 (a) → 'a' → step 1 (b) → 'b' → step 0 (a)" in str(info.value)


def test_a_tensor_without_a_datatype_is_refused_naming_it(tmp_path: Path) -> None:
    repository(tmp_path)
    config = tmp_path / "chain" / "config.pbtxt"
    config.write_text(config.read_text().replace("data_type: TYPE_FP32, ", ""))
    with pytest.raises(ConfigError) as info:
        load_repository_ensembles(tmp_path)
    assert str(config) in str(info.value) and "output 'OUT'" in str(info.value)


def test_other_models_and_unreadable_entries_are_not_the_routers(tmp_path: Path, caplog) -> None:
    repository(tmp_path)
    (tmp_path / "net" / "1").mkdir(parents=True)
    (tmp_path / "net" / "1" / "model.onnx").write_bytes(b"")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.pbtxt").write_text("platform: {")
    with caplog.at_level(logging.WARNING, logger="pipeline.ensemble.pbtxt"):
        plans = load_repository_ensembles(tmp_path)
    assert [plan.name for plan in plans] == ["chain"]
    assert "broken" in caplog.text and "config.pbtxt" in caplog.text


def test_yaml_and_repository_ensembles_share_one_catalog(tmp_path: Path) -> None:
    repository(tmp_path / "models")
    (tmp_path / "solo.yaml").write_text(
        """
stages: {math: {address: "127.0.0.1:9001", max_inflight_requests: 4}}
inputs: [{name: A, datatype: FP32, shape: [-1, 4]}]
outputs: [{name: S, datatype: FP32, shape: [-1, 4]}]
steps: [{model_name: add, stage: math, input_map: {A: A}, output_map: {S: S}}]
"""
    )
    catalog = load_catalog(
        [tmp_path / "solo.yaml"],
        repository=tmp_path / "models",
        stages={"model": "127.0.0.1:9002", "math": "127.0.0.1:9001"},
    )
    assert sorted(catalog.ensembles) == ["chain", "solo"]
    # The router's stages come first; the file says more of 'math' (its limit) than the flag.
    assert list(catalog.stages) == ["model", "math"]
    assert catalog.stages["math"].max_inflight_requests == 4
    assert catalog.stage_models() == {"add": "math"}  # chain's steps name no stage

    with pytest.raises(ConfigError) as info:
        load_catalog([tmp_path / "solo.yaml"], stages={"math": "127.0.0.1:9009"})
    assert (
        "stage 'math' has address '127.0.0.1:9001', but --stage declares it with address '127.0.0.1:9009'"
        in (str(info.value))
    )
    with pytest.raises(ConfigError, match="stage 'model': address 'nowhere'"):
        load_catalog([tmp_path / "solo.yaml"], stages={"model": "nowhere"})


def test_ensembles_that_state_a_models_batching_differently_fail_the_later_one_alone() -> None:
    def plan(name: str, batching: object) -> object:
        step = {"model_name": "m", "input_map": {"X": "X"}, "output_map": {"Y": "Y"}}
        if batching is not None:
            step["dynamic_batching"] = batching
        data = {
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, 1]}],
            "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 1]}],
            "steps": [step],
        }
        return compile_ensemble(data, f"{name}.yaml", default_name=name)

    # One ensemble may state the batching of a model that no other source sets; the others share it.
    catalog = build_catalog([plan("a", None), plan("b", False), plan("c", None)])
    assert sorted(catalog.ensembles) == ["a", "b", "c"] and not catalog.failed
    assert declared_batching(catalog.ensembles.values()) == {"m": (None, "b.yaml (step 0 (m))")}

    delay = {"max_queue_delay_microseconds": 500}
    loaded = [plan("a", delay), plan("b", None), plan("c", False), plan("d", delay)]
    with pytest.raises(ConfigError) as info:
        build_catalog(loaded)
    assert str(info.value) == (
        "c.yaml (step 0 (m)): model 'm' has dynamic_batching off here but "
        f"({BatchingConfig(max_queue_delay_microseconds=500)}) in a.yaml (step 0 (m)); a model has one "
        "batcher, so one setting: declare it once, in the model's config.pbtxt"
    )
    catalog = build_catalog(loaded, exit_on_error=False)
    assert sorted(catalog.ensembles) == ["a", "b", "d"] and list(catalog.failed) == ["c"]
    assert catalog.failed["c"] == str(info.value)


def test_a_models_own_dynamic_batching_becomes_the_routers_batching() -> None:
    config = mc.ModelConfig(name="m", max_batch_size=16)
    assert batching_of_config(config) is None  # none set: one request per stage call
    config.dynamic_batching.SetInParent()
    assert batching_of_config(config) == BatchingConfig(
        max_batch_size=16, max_queue_delay_microseconds=0, allow_timeout_override=False, max_queue_size=0
    )
    config.ClearField("dynamic_batching")
    text_format.Merge(
        """
        dynamic_batching {
          preferred_batch_size: [4, 8] max_queue_delay_microseconds: 500 preserve_ordering: true
          priority_levels: 3 default_priority_level: 2
          default_queue_policy { max_queue_size: 100 default_timeout_microseconds: 7000 allow_timeout_override: true }
        }""",
        config,
    )
    batching = batching_of_config(config)
    assert batching is not None
    assert (
        batching.max_batch_size,
        batching.preferred_batch_size,
        batching.max_queue_delay_microseconds,
    ) == (
        16,
        (4, 8),
        500,
    )
    assert (batching.priority_levels, batching.default_priority_level, batching.preserve_ordering) == (
        3,
        2,
        True,
    )
    assert (
        batching.max_queue_size,
        batching.default_timeout_microseconds,
        batching.allow_timeout_override,
    ) == (
        100,
        7000,
        True,
    )
    assert batching.max_inflight_batches == 1, "no instance_group: one instance, one batch in flight"
    # One batch in flight per instance: 2 on the CPU, and 3 on each of two GPUs.
    text_format.Merge(
        "instance_group [{ count: 2 kind: KIND_CPU }, { count: 3 kind: KIND_GPU gpus: [0, 1] }]", config
    )
    assert batching_of_config(config).max_inflight_batches == 8  # type: ignore[union-attr]
    config.max_batch_size = 0  # a model that does not batch gets no batcher
    assert batching_of_config(config) is None
    config.max_batch_size = 6
    with pytest.raises(ValueError, match=r"preferred_batch_size 8 is outside 1\.\.max_batch_size"):
        batching_of_config(config)


def test_the_routers_own_batching_knobs_come_from_the_models_parameters() -> None:
    config = text_format.Parse(
        """
        max_batch_size: 16
        instance_group [{ count: 2 kind: KIND_CPU }]
        dynamic_batching { max_queue_delay_microseconds: 20000 }
        parameters [
          { key: "pipeline.batch_upcoming", value: { string_value: "false" } },
          { key: "pipeline.idle_dispatch", value: { string_value: " False " } },
          { key: "pipeline.max_inflight_batches", value: { string_value: "3" } }
        ]""",
        mc.ModelConfig(),
    )
    batching = batching_of_config(config)
    assert batching is not None
    assert (batching.batch_upcoming, batching.idle_dispatch, batching.max_inflight_batches) == (
        False,
        False,
        3,
    )
    del config.parameters["pipeline.max_inflight_batches"]  # one batch per instance, then
    config.parameters["pipeline.batch_upcoming"].string_value = "true"
    batching = batching_of_config(config)
    assert batching is not None and (batching.batch_upcoming, batching.max_inflight_batches) == (True, 2)

    config.parameters["pipeline.batch_upcoming"].string_value = "yes"
    with pytest.raises(
        ValueError, match=re.escape("parameter 'pipeline.batch_upcoming' is 'yes'; expected true or false")
    ):
        batching_of_config(config)
    config.parameters["pipeline.batch_upcoming"].string_value = "true"
    config.parameters["pipeline.max_inflight_batches"].string_value = "0"
    with pytest.raises(
        ValueError, match=re.escape("'pipeline.max_inflight_batches' is '0'; expected an integer >= 1")
    ):
        batching_of_config(config)
    # Without dynamic_batching the knobs say nothing: the model is not batched.
    config.ClearField("dynamic_batching")
    assert batching_of_config(config) is None


def test_an_ensemble_that_fails_to_load_fails_alone_without_exit_on_error(tmp_path: Path) -> None:
    good = """
stages: {s: {address: "127.0.0.1:9001"}}
inputs: [{name: X, datatype: FP32, shape: [-1, 1]}]
outputs: [{name: Y, datatype: FP32, shape: [-1, 1]}]
steps: [{model_name: m, stage: s, input_map: {X: X}, output_map: {Y: Y}}]
"""
    (tmp_path / "good.yaml").write_text(good)
    (tmp_path / "broken.yaml").write_text("inputs: [")
    (tmp_path / "named.yaml").write_text("name: mine\n" + good.replace("Y: Y}", "Y: Z}"))
    (tmp_path / "moved.yaml").write_text(
        good.replace("9001", "9002").replace("model_name: m", "model_name: n")
    )
    with pytest.raises(ConfigError) as info:
        load_catalog([tmp_path])
    message = str(info.value)
    assert "broken.yaml: line 1, column 10: invalid YAML" in message
    assert "named.yaml: ensemble output 'Y': no step produces it" in message
    assert "moved.yaml: stage 's' has address '127.0.0.1:9002', but" in message

    catalog = load_catalog([tmp_path], exit_on_error=False)
    assert list(catalog.ensembles) == ["good"]
    # Each is named as it names itself, else by its file.
    assert sorted(catalog.failed) == ["broken", "mine", "moved"]
    assert catalog.failed["mine"].startswith(f"{tmp_path / 'named.yaml'}: ensemble output 'Y'")
    assert catalog.failed["moved"].endswith("a stage key must name one endpoint")

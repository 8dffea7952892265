"""Conditional steps in the one compiler: the `when:` vocabulary, switches, exclusive producers, outputs on
every path, the config.pbtxt form, and the condition value a request supplies."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from google.protobuf import text_format

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.ensemble.compiler import compile_ensemble
from pipeline.ensemble.pbtxt import compile_model_config, ensemble_config
from pipeline.ensemble.plan import ModelSignature
from pipeline.ensemble.signatures import check_signatures
from pipeline.protocol.codec import Tensor
from pipeline.protocol.errors import ConfigError, InvalidInput
from pipeline.protocol.types import TensorSpec
from pipeline.router.execution.branches import condition_value

REPO = Path(__file__).resolve().parents[2]

#: A cheap check, then either the expensive model and its postprocess, or a fixed answer.
GATED: dict[str, Any] = {
    "name": "gated",
    "stages": {"s": {"address": "127.0.0.1:8101"}},
    "inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "LABEL", "datatype": "INT64", "shape": [-1, 1]}],
    "steps": [
        {"model_name": "check", "stage": "s", "input_map": {"X": "IMAGE"}, "output_map": {"SCORE": "score"}},
        {
            "model_name": "model",
            "stage": "s",
            "when": {"tensor": "score", "greater_equal": 0.5},
            "input_map": {"X": "IMAGE"},
            "output_map": {"LOGITS": "logits"},
        },
        {
            "model_name": "post",
            "stage": "s",
            "input_map": {"LOGITS": "logits"},
            "output_map": {"LABEL": "LABEL"},
        },
        {
            "model_name": "fixed",
            "stage": "s",
            "when": {"tensor": "score", "less_than": 0.5},
            "input_map": {"SCORE": "score"},
            "output_map": {"LABEL": "LABEL"},
        },
    ],
}


def gated() -> dict[str, Any]:
    return copy.deepcopy(GATED)


def error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        compile_ensemble(data, "gated.yaml")
    return str(info.value)


def test_complementary_comparisons_may_share_a_producer():
    plan = compile_ensemble(gated(), "gated.yaml")
    by_index = {step.index: step for step in plan.steps}
    assert str(by_index[1].when) == "'score' >= 0.5"
    assert by_index[3].when is not None and by_index[3].when.holds(0.25)
    assert not by_index[3].when.holds(0.5)
    assert by_index[1].depends_on == (0,)  # the condition tensor's producer
    assert plan.conditional


@pytest.mark.parametrize(
    ("op", "value", "holds", "fails"),
    [
        ("equals", 2, 2.0, 3.0),
        ("not_equals", 2, 3.0, 2.0),
        ("greater_than", 2, 2.5, 2.0),
        ("greater_equal", 2, 2.0, 1.5),
        ("less_than", 2, 1.5, 2.0),
        ("less_equal", 2, 2.0, 2.5),
        ("equals", "en", "en", "fr"),
        ("not_equals", "en", "fr", "en"),
    ],
)
def test_every_comparison(op, value, holds, fails):
    data = gated()
    data["steps"][1]["when"] = {"tensor": "score", op: value}
    data["steps"][3]["when"] = None
    data["steps"][3]["output_map"] = {"LABEL": "fallback"}
    data["outputs"][0]["optional"] = True
    step = next(s for s in compile_ensemble(data, "gated.yaml").steps if s.index == 1)
    assert step.when is not None and step.when.holds(holds) and not step.when.holds(fails)


def test_overlapping_conditions_are_not_exclusive():
    data = gated()
    data["steps"][3]["when"] = {"tensor": "score", "less_than": 0.75}
    message = error(data)
    assert "gated.yaml: step 3 (fixed): output 'LABEL' → tensor 'LABEL'" in message
    assert "also produced by step 2 (post) output 'LABEL'" in message
    assert "'score' is 0.5" in message  # a value for which both run
    assert "exclude each other" in message


def test_an_unconditional_second_producer_is_refused():
    data = gated()
    data["steps"][3]["when"] = None
    message = error(data)
    assert "step 3 (fixed): output 'LABEL' → tensor 'LABEL'" in message and "both run" in message


def test_an_output_missing_on_some_path_is_refused_unless_optional():
    data = gated()
    data["steps"][3]["when"] = {"tensor": "score", "less_than": 0.25}  # 0.25 <= score < 0.5: no LABEL
    message = error(data)
    assert (
        "gated.yaml: ensemble output 'LABEL': no step produces it for a request where 'score' is 0.25 "
        in message
    )
    assert "optional: true" in message
    data["outputs"][0]["optional"] = True
    plan = compile_ensemble(data, "gated.yaml")
    assert plan.optional_outputs == frozenset({"LABEL"})


SWITCHED: dict[str, Any] = {
    "name": "switched",
    "stages": {"s": {"address": "127.0.0.1:8101"}},
    "inputs": [
        {"name": "LANG", "datatype": "BYTES", "shape": [-1, 1]},
        {"name": "X", "datatype": "FP32", "shape": [-1, 4]},
    ],
    "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 4]}],
    "switches": {
        "lang": {"tensor": "LANG", "cases": [{"name": "en", "equals": "en"}, {"name": "fr", "equals": "fr"}]}
    },
    "steps": [
        {
            "model_name": f"m_{case}",
            "stage": "s",
            "when": {"switch": "lang", "case": case},
            "input_map": {"X": "X"},
            "output_map": {"Y": "Y"},
        }
        for case in ("en", "fr", "default")
    ],
}


def test_a_switch_takes_the_first_case_that_holds_else_default():
    plan = compile_ensemble(copy.deepcopy(SWITCHED), "switched.yaml")
    when = {step.model_name: step.when for step in plan.steps}
    assert when["m_en"] is not None and when["m_en"].holds("en") and not when["m_en"].holds("fr")
    assert when["m_default"] is not None and when["m_default"].holds("de")
    assert not when["m_default"].holds("fr")


def test_a_switch_without_default_leaves_a_path_without_output():
    data = copy.deepcopy(SWITCHED)
    data["steps"].pop()
    message = error(data)
    assert "ensemble output 'Y': no step produces it for a request where 'LANG' is" in message


@pytest.mark.parametrize(
    ("when", "expected"),
    [
        (
            {"switch": "nope", "case": "en"},
            "step 0 (m_en): when: switch 'nope' is not declared under 'switches' (declared: lang)",
        ),
        (
            {"switch": "lang", "case": "es"},
            "step 0 (m_en): when: switch 'lang' has no case 'es' (its cases: en, fr, default)",
        ),
        ({"switch": "lang"}, "a switch's branch names both 'switch' and 'case'"),
        ({"tensor": "LANG"}, "give exactly one comparison"),
        ({"tensor": "LANG", "equals": "en", "not_equals": "fr"}, "given: equals, not_equals"),
        ({"tensor": "LANG", "greater_than": "en"}, "steps[0].when.greater_than"),
        ({"tensor": "LANG", "equals": "en", "switch": "lang", "case": "en"}, "not both"),
        ({"tensor": "LANG", "matches": "e.*"}, "unknown key 'matches'"),
        (
            {"tensor": "nowhere", "equals": "en"},
            "step 0 (m_en): condition tensor 'nowhere': nothing produces 'nowhere'",
        ),
    ],
)
def test_bad_conditions_name_the_file_and_step(when, expected):
    data = copy.deepcopy(SWITCHED)
    data["steps"][0]["when"] = when
    message = error(data)
    assert message.startswith("gated.yaml: ")
    assert expected in message


def test_bad_switches_are_refused():
    data = copy.deepcopy(SWITCHED)
    data["switches"]["lang"]["cases"].append({"name": "default", "equals": "de"})
    assert "'default' is the name of the branch no case takes" in error(data)
    data = copy.deepcopy(SWITCHED)
    data["switches"]["lang"]["cases"].append({"name": "en", "equals": "EN"})
    assert "case name(s) en given more than once" in error(data)


def test_strings_and_numbers_on_one_tensor_are_refused():
    data = gated()
    data["steps"][3]["when"] = {"tensor": "score", "not_equals": "high"}
    assert "compare it with strings and with numbers" in error(data)


def test_the_condition_datatype_is_checked_against_the_stage():
    plan = compile_ensemble(gated(), "gated.yaml")
    spec = TensorSpec
    signatures = {
        "check": ModelSignature(
            "check", (spec("X", "FP32", (-1, 4)),), (spec("SCORE", "BYTES", (-1, 1)),), 8
        ),
        "model": ModelSignature(
            "model", (spec("X", "FP32", (-1, 4)),), (spec("LOGITS", "FP32", (-1, 10)),), 8
        ),
        "post": ModelSignature(
            "post", (spec("LOGITS", "FP32", (-1, 10)),), (spec("LABEL", "INT64", (-1, 1)),), 8
        ),
        "fixed": ModelSignature(
            "fixed", (spec("SCORE", "BYTES", (-1, 1)),), (spec("LABEL", "INT64", (-1, 1)),), 8
        ),
    }
    with pytest.raises(ConfigError) as info:
        check_signatures(plan, signatures)
    assert "step 1 (model): condition on tensor 'score': the tensor is BYTES" in str(info.value)
    assert "compares it with a number" in str(info.value)


def test_the_example_ensemble_compiles_and_round_trips_through_config_pbtxt():
    data = yaml.safe_load((REPO / "model_repository" / "digits_gated" / "ensemble.yaml").read_text())
    plan = compile_ensemble(data, "digits_gated.yaml")
    config = ensemble_config(plan)
    text = text_format.MessageToString(config)
    assert 'key: "step.1.when"' in text and 'key: "switch.ink"' in text
    again = compile_model_config(text_format.Parse(text, mc.ModelConfig()), "config.pbtxt")
    assert [(s.index, s.when) for s in again.steps] == [(s.index, s.when) for s in plan.steps]


CONFIG_PBTXT = """
name: "gated_triton"
platform: "ensemble"
max_batch_size: 8
response_cache { enable: true }
input [ { name: "IMAGE" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "LABEL" data_type: TYPE_INT64 dims: [ 1 ] } ]
parameters { key: "step.1.when" value { string_value: "{tensor: score, greater_equal: 0.5}" } }
parameters { key: "optional_outputs" value { string_value: "LABEL" } }
ensemble_scheduling {
  step [
    { model_name: "check" input_map { key: "X" value: "IMAGE" } output_map { key: "SCORE" value: "score" } },
    { model_name: "model" input_map { key: "X" value: "IMAGE" } output_map { key: "LABEL" value: "LABEL" } }
  ]
}
"""


def test_a_config_pbtxt_ensemble_carries_conditions_in_parameters():
    plan = compile_model_config(
        text_format.Parse(CONFIG_PBTXT, mc.ModelConfig()), "gated_triton/config.pbtxt"
    )
    assert str(next(s for s in plan.steps if s.index == 1).when) == "'score' >= 0.5"
    assert plan.optional_outputs == frozenset({"LABEL"}) and plan.response_cache
    broken = CONFIG_PBTXT.replace("greater_equal: 0.5", "greater_equal: high")
    with pytest.raises(ConfigError) as info:
        compile_model_config(text_format.Parse(broken, mc.ModelConfig()), "gated_triton/config.pbtxt")
    assert "gated_triton/config.pbtxt: step 1 (model): steps[1].when.greater_equal" in str(info.value)
    # Without `optional_outputs`, the path where the model is skipped has no LABEL.
    strict = CONFIG_PBTXT.replace(
        'parameters { key: "optional_outputs" value { string_value: "LABEL" } }\n', ""
    )
    with pytest.raises(ConfigError) as info:
        compile_model_config(text_format.Parse(strict, mc.ModelConfig()), "gated_triton/config.pbtxt")
    assert "gated_triton/config.pbtxt: ensemble output 'LABEL': no step produces it" in str(info.value)


def test_a_condition_reads_one_value():
    assert condition_value(Tensor.from_array("S", np.array([[0.25]], np.float32)), "here") == 0.25
    assert condition_value(Tensor.from_array("L", np.array([[b"en"]], dtype=object)), "here") == "en"
    with pytest.raises(InvalidInput) as info:
        condition_value(Tensor.from_array("S", np.zeros((2, 1), np.float32)), "ensemble 'e' step 1 (m)")
    assert "ensemble 'e' step 1 (m): condition tensor 'S' holds 2 elements" in info.value.message

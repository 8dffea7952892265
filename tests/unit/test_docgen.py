"""The reference pages in docs/reference/ are what the argument parsers give (run `make docs-reference` after
changing a flag, its help or its default)."""

import argparse

from pipeline import docgen


def test_the_reference_pages_are_fresh():
    stale = docgen.stale()
    assert not stale, f"stale reference pages {stale}: run `make docs-reference`"


def test_every_subcommand_flag_and_variable_is_in_the_reference(monkeypatch):
    monkeypatch.setenv(
        "PIPELINE_MODEL_DIR", "/somewhere/else"
    )  # the pages never show the environment's values
    pages = docgen.generate()
    cli, services = docgen.commands()
    assert [c.name for c in cli] == [
        "pipeline",
        "pipeline run",
        "pipeline router",
        "pipeline infer",
        "pipeline bench",
        "pipeline trace",
        "pipeline quantize",
    ]
    for page, group in (("cli.md", cli), ("services.md", services)):
        for command in group:
            assert f"## `{command.name}`" in pages[page]
            for action in command.parser._actions:
                if action.help != argparse.SUPPRESS and not isinstance(
                    action, (argparse._SubParsersAction, argparse._HelpAction)
                ):
                    for option in action.option_strings:
                        assert f"`{option}" in pages[page], (command.name, option)
    assert "/somewhere/else" not in "".join(pages.values())
    assert "frozenset" not in "".join(pages.values())  # an empty set's default is shown empty
    # `pipeline trace`'s file is a positional: it reads no variable, the services' trace exporter does.
    [trace_file] = [line for line in pages["environment.md"].splitlines() if "`PIPELINE_TRACE_FILE`" in line]
    assert "`traces.jsonl`" in trace_file and "exporter" in trace_file and "pipeline trace" not in trace_file
    assert "| `PIPELINE_MODEL_DIR` | `model_repository` |" in pages["environment.md"]
    for variable in (
        "PIPELINE_ROUTER_PORT",
        "PIPELINE_MODEL_METRICS_PORT",
        "PREPROCESS_ADDRESS",
        "PIPELINE_TOKEN",
    ):
        assert f"| `{variable}` |" in pages["environment.md"]


def test_the_model_configuration_page_covers_every_field_and_follows_the_services_list(monkeypatch):
    from pipeline._gen.inference import model_config_pb2 as mc
    from pipeline.docgen import config_reference
    from pipeline.protocol import config_fields

    page = config_reference.page()
    for field in mc.ModelConfig.DESCRIPTOR.fields:
        assert f"| `{field.name}` |" in page, field.name
    assert "| `optimization` | ignored | ignored | differently |" in page
    assert "| `model_transaction_policy` | ignored | yes | ignored |" in page
    assert "| `model_repository_agents` | ignored | ignored | ignored |" in page
    # The page follows the one list the services act on: a field taken off it reads as ignored.
    kept = tuple(f for f in config_fields.FIELDS if f.name != "model_warmup")
    monkeypatch.setattr(config_fields, "FIELDS", kept)
    assert "| `model_warmup` | ignored | ignored | ignored |" in config_reference.page()
    assert "model_warmup" not in config_fields.acted_on("python")


def test_the_services_act_on_the_fields_the_list_gives():
    from pipeline.ensemble import pbtxt
    from pipeline.protocol.config_fields import acted_on
    from pipeline.stage import python_backend
    from services.model import backend

    assert acted_on("ensemble") == pbtxt.ENSEMBLE_FIELDS
    assert acted_on("python") == python_backend.ACTED_ON
    assert acted_on("model") == backend.ACTED_ON


def test_the_config_fields_list_names_only_real_fields():
    from pipeline._gen.inference import model_config_pb2 as mc
    from pipeline.protocol.config_fields import FIELDS, KINDS

    assert {f.name for f in FIELDS} <= set(mc.ModelConfig.DESCRIPTOR.fields_by_name)
    assert all(f.acted_on <= set(KINDS) for f in FIELDS)


def test_the_ensemble_yaml_page_describes_every_key_of_the_schema():
    from pipeline.docgen import ensemble_schema

    sections = ensemble_schema.page().split("\n## ")[1:]
    assert len(sections) == len(ensemble_schema.SECTIONS)
    for (model, _), section in zip(ensemble_schema.SECTIONS, sections, strict=True):
        assert f"(`{model.__name__}`)" in section.splitlines()[0]
        for name in model.model_fields:
            [row] = [line for line in section.splitlines() if line.startswith(f"| `{name}` |")]
            assert not row.endswith("|  |"), f"{model.__name__}.{name} has no `#:` comment"


def test_the_pb_utils_page_lists_every_public_name_of_the_module():
    from pipeline.docgen import python_api
    from pipeline.stage import triton_python_backend_utils as pb_utils

    page = python_api.pb_utils_page()
    public = [n for n in vars(pb_utils) if not n.startswith("_")]
    offered = python_api.public_names(pb_utils, reexports=True)
    for name in ("InferenceRequest", "InferenceResponse", "Tensor", "MetricFamily", "Logger", "load_model"):
        assert name in offered
    for name in offered:
        assert f"`{name}`" in page, name
    assert {"asyncio", "np", "grpc", "Any"}.isdisjoint(offered) and set(offered) <= set(public)


def test_the_grpc_page_renders_every_rpc_of_the_protos():
    from pipeline._gen.inference import grpc_service_pb2 as pb
    from pipeline.docgen import grpc_api

    page = grpc_api.page()
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        assert f"| `{method.name}` |" in page, method.name
    assert "| `ModelStreamInfer` | stream [`ModelInferRequest`](#modelinferrequest) |" in page
    assert "Raw input bytes, one entry per input" in page  # the protos' own comments

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
    assert "| `PIPELINE_MODEL_DIR` | `model_repository` |" in pages["environment.md"]
    for variable in (
        "PIPELINE_ROUTER_PORT",
        "PIPELINE_MODEL_METRICS_PORT",
        "PREPROCESS_ADDRESS",
        "PIPELINE_TOKEN",
    ):
        assert f"| `{variable}` |" in pages["environment.md"]

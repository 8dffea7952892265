"""The ensemble YAML reference (docs/reference/ensemble-yaml.md), from the schema's pydantic models
(`pipeline.ensemble.schema`): every key, its type, its default and its `#:` comment, and each model's
docstring."""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from pipeline.docgen.page import attribute_comments, cell, header, slug
from pipeline.ensemble import schema
from pipeline.protocol.types import BatchingConfig

#: The schema's models in the order the page shows them, each with the heading it gets there.
SECTIONS: tuple[tuple[type[BaseModel], str], ...] = (
    (schema.EnsembleConfig, "The file"),
    (schema.TensorConfig, "An input or output"),
    (schema.StageConfig, "A stage"),
    (schema.StepConfig, "A step"),
    (schema.DynamicBatchingConfig, "Batching"),
    (schema.WhenConfig, "A condition"),
    (schema.SwitchConfig, "A switch"),
    (schema.CaseConfig, "A case"),
    (schema.ResponseCacheConfig, "The response cache"),
)


def _heading(model: str) -> str:
    return next(f"{title} (`{cls.__name__}`)" for cls, title in SECTIONS if cls.__name__ == model)


def _type(prop: dict[str, Any]) -> str:
    """A JSON schema property in words: `integer ≥ 0`, `list of [A step](#...)`, ..."""
    if "$ref" in prop:
        heading = _heading(prop["$ref"].rsplit("/", 1)[-1])
        return f"[{heading.split(' (')[0].lower()}](#{slug(heading)})"
    if "anyOf" in prop:
        kinds = [_type(p) for p in prop["anyOf"] if p.get("type") != "null"]
        if "number" in kinds and "integer" in kinds:
            kinds.remove("integer")
        return " or ".join(kinds)
    if "const" in prop:
        return f"`{str(prop['const']).lower()}`"
    kind = prop.get("type")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}))}"
    if kind == "object":
        return f"map of name to {_type(prop.get('additionalProperties', {}))}"
    if kind == "integer" and "minimum" in prop:
        return f"integer ≥ {prop['minimum']}"
    return {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean"}.get(
        str(kind), "integer or string"
    )


def _default(model: type[BaseModel], name: str) -> str:
    field = model.model_fields[name]
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default is PydanticUndefined else field.default  # type: ignore[call-arg, misc]
    if isinstance(value, BaseModel) or value in (None, (), {}):
        return ""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _section(model: type[BaseModel], title: str, properties: dict[str, Any]) -> list[str]:
    comments = attribute_comments(model)
    if model is schema.DynamicBatchingConfig:  # its knobs are `BatchingConfig`'s, documented there
        comments = attribute_comments(BatchingConfig) | comments
    doc = inspect.cleandoc(model.__doc__ or "")
    lines = [f"## {title} (`{model.__name__}`)", "", doc, "", "| key | type | default | what it is |"]
    lines.append("|---|---|---|---|")
    for name, prop in properties.items():
        lines.append(
            f"| `{name}` | {_type(prop)} | {_default(model, name)} | {cell(comments.get(name, ''))} |"
        )
    return [*lines, ""]


def page() -> str:
    """The page's Markdown."""
    root = schema.EnsembleConfig.model_json_schema()
    definitions = root.get("$defs", {})
    lines = [
        "# Ensemble YAML",
        "",
        "An ensemble file under `ensembles/` (or the folder `--ensembles` names) is checked against this",
        "schema when the router loads it: an unknown key, a value of the wrong type or out of bounds refuses the",
        "file, naming the key. A file is [the file](#the-file-ensembleconfig) below; see",
        "[Ensembles](../ensembles/index.md) for what each part does, with examples.",
        "",
    ]
    for model, title in SECTIONS:
        properties = (
            root["properties"]
            if model is schema.EnsembleConfig
            else definitions[model.__name__]["properties"]
        )
        lines += _section(model, title, properties)
    return header("`pipeline.ensemble.schema`") + "\n".join(lines).rstrip() + "\n"

"""Reading ensemble YAML: a strict loader (no duplicate keys, no arbitrary objects), and the schema's
validation errors in words that name the file, the step and the tensor."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.ensemble.schema import EnsembleConfig, StageConfig, StepConfig, SwitchConfig, TensorConfig
from pipeline.protocol.errors import ConfigError


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of silently keeping the last one."""


def _construct_mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, str | int | float | bool) and key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"duplicate key {key!r} (first at line {seen[key].start_mark.line + 1})",
                key_node.start_mark,
            )
        if isinstance(key, str | int | float | bool):
            seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


_ALLOWED_KEYS: dict[str, type[BaseModel]] = {
    "inputs": TensorConfig,
    "outputs": TensorConfig,
    "steps": StepConfig,
    "stages": StageConfig,
    "switches": SwitchConfig,
}


def read_yaml(path: Path, source: str) -> Any:
    """The YAML of an ensemble file; `ConfigError` naming `source` where it cannot be read or parsed."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the file: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: byte {exc.start}: not UTF-8 text (YAML files are UTF-8)") from None
    try:
        return yaml.load(text, Loader=StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        detail = f"{problem} ({context})" if context else problem
        raise ConfigError(f"{source}: {where}invalid YAML: {detail}") from exc


def _context(loc: tuple[Any, ...], raw: Mapping[str, Any]) -> str:
    """`step N (model_name): ` or `input 'X': ` for a location inside a list item, else ''."""
    if len(loc) < 2 or loc[0] not in ("steps", "inputs", "outputs") or not isinstance(loc[1], int):
        return ""
    items = raw.get(loc[0])
    if not isinstance(items, list) or loc[1] >= len(items) or not isinstance(items[loc[1]], dict):
        return ""
    item = items[loc[1]]
    if loc[0] == "steps":
        return f"step {loc[1]} ({item.get('model_name', '?')}): "
    name = item.get("name")
    return f"{'input' if loc[0] == 'inputs' else 'output'} '{name}': " if name is not None else ""


def _path(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part == "[key]":
            text += " (key)"
        else:
            text += f".{part}" if text else str(part)
    return text or "top level"


# pydantic's words for Python types, in YAML's words.
_TYPE_WORDS = {
    "tuple_type": "a list",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
}


def _explain(error: Any, raw: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        parent = loc[:-1]
        model = EnsembleConfig if not parent else _ALLOWED_KEYS.get(parent[0]) if len(parent) == 2 else None
        allowed = f" (allowed: {', '.join(model.model_fields)})" if model is not None else ""
        return f"{_context(loc, raw)}{_path(parent)}: unknown key '{loc[-1]}'{allowed}"
    if kind == "missing":
        return f"{_context(loc, raw)}{_path(loc[:-1])}: missing required key '{loc[-1]}'"
    message = _message(error)
    if kind in _TYPE_WORDS:
        message = f"must be {_TYPE_WORDS[kind]}, found {_kind(error['input'])}"
    elif kind == "string_too_short":
        message = "must not be empty"
    return f"{_context(loc, raw)}{_path(loc)}: {message}"


def _kind(value: Any) -> str:
    """What a YAML value is, in YAML's words."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    return f"a {type(value).__name__} ({value!r})"


def validate_ensemble(data: Any, source: str, *, environ: Mapping[str, str] | None = None) -> EnsembleConfig:
    """An ensemble already parsed from YAML, validated against the schema; `ConfigError` naming `source`, the
    step and the tensor of every error. `environ` (default `os.environ`) expands `${VAR}` in stage addresses.
    """
    if data is None:
        raise ConfigError(
            f"{source}: the file is empty; expected a mapping with stages, inputs, outputs, steps"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: the top level must be a mapping (name, stages, inputs, outputs, steps), "
            f"found {_kind(data)}"
        )
    try:
        return EnsembleConfig.model_validate(data, context=_validation_context(environ))
    except ValidationError as exc:
        lines = [f"{source}: {_explain(error, data)}" for error in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def validate_stage_address(key: str, address: str, *, environ: Mapping[str, str] | None = None) -> str:
    """A stage address given by key (`--stage NAME=ADDRESS`), checked and expanded as an ensemble file's
    `stages` entry is."""
    try:
        stage = StageConfig.model_validate({"address": address}, context=_validation_context(environ))
    except ValidationError as exc:
        causes = "; ".join(_message(e) for e in exc.errors())
        raise ConfigError(f"stage '{key}': {causes}") from None
    return stage.address


def _validation_context(environ: Mapping[str, str] | None) -> dict[str, Any]:
    """What the schema's validators read: the environment that expands `${VAR}` (default `os.environ`)."""
    return {"environ": os.environ if environ is None else environ}


def _message(error: Any) -> str:
    """A validator's own message, without pydantic's prefix."""
    return str(error["msg"]).removeprefix("Value error, ")

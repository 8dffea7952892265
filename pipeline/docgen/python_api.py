"""The Python API references (docs/reference/stage-api.md, pb-utils.md, python-client.md), from the modules
themselves: their public names, signatures, docstrings and `#:` comments, so a name added or removed shows."""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Iterator
from enum import Enum
from typing import Any

from pipeline.docgen.page import attribute_comments, cell, header


def _first_paragraph(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _signature(name: str, obj: Any) -> str:
    """`name(arguments) -> result` as the source writes it (no `self`, `cls` or quotes)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    parameters = [
        p.replace(annotation=_Written(p.annotation)) if isinstance(p.annotation, str) else p
        for p in signature.parameters.values()
        if p.name not in ("self", "cls")
    ]
    result = signature.return_annotation
    signature = signature.replace(
        parameters=parameters, return_annotation=_Written(result) if isinstance(result, str) else result
    )
    return name + re.sub(r"<built-in function (\w+)>", r"time.\1", str(signature))


class _Written:
    """An annotation as the source writes it (the modules' annotations are strings, which `inspect` quotes)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _constructor(name: str, cls: type) -> list[str]:
    """The signature block of a class whose constructor takes arguments."""
    takes_nothing = all("__init__" not in vars(klass) for klass in cls.__mro__[:-1])
    if (takes_nothing and not hasattr(cls, "__dataclass_fields__")) or issubclass(cls, Enum):
        return []
    if _signature(name, cls) == name:  # a signature inspect cannot read (a builtin's)
        return []
    return ["```python", _signature(name, cls), "```", ""]


def _ours(obj: Any) -> bool:
    return str(getattr(obj, "__module__", "")).split(".")[0] in ("pipeline", "services")


def public_names(module: types.ModuleType, reexports: bool = False) -> list[str]:
    """What a module offers: its `__all__`, else every name not starting with `_` that is a class or function
    of this project's, or a constant (an upper-case name), in the order the module defines them; with
    `reexports`, those it imports from the project's other modules too (the `import X as X` form)."""
    declared = getattr(module, "__all__", None)
    if declared is not None:
        return list(declared)
    assigned = set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*[:=]", inspect.getsource(module), re.MULTILINE))
    names = []
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        if inspect.isclass(value) or inspect.isfunction(value):
            if _ours(value) and (reexports or value.__module__ == module.__name__):
                names.append(name)
        elif name.isupper() and (reexports or name in assigned):
            names.append(name)
    return names


def _members(cls: type) -> Iterator[tuple[str, str]]:
    """(signature, what it does) of a class's public attributes, properties and methods it defines."""
    comments = attribute_comments(cls)
    for name in [*getattr(cls, "__annotations__", {}), *vars(cls)]:
        if name.startswith("_"):
            continue
        value = inspect.getattr_static(cls, name, None)
        if name in comments:
            yield f"{name}", comments[name]
        elif isinstance(value, (staticmethod, classmethod)) or inspect.isfunction(value):
            function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            yield _signature(name, function), _first_paragraph(function)
        elif isinstance(value, property):
            yield name, _first_paragraph(value)
        elif name.isupper() and not name.startswith("_"):
            yield name, ""


def _unique(rows: Iterator[tuple[str, str]]) -> list[tuple[str, str]]:
    seen: set[str] = set()
    found = []
    for signature, text in rows:
        key = signature.split("(")[0]
        if key not in seen:
            seen.add(key)
            found.append((signature, text))
    return found


def module_reference(module: types.ModuleType, reexports: bool = False) -> str:
    """Each public name of `module` (`public_names`) as Markdown: classes with their members, functions,
    constants."""
    comments = attribute_comments(module)
    lines: list[str] = []
    constants = []
    for name in public_names(module, reexports):
        value = getattr(module, name)
        if inspect.isclass(value):
            lines += [f"### `{name}`", "", *_constructor(name, value), _first_paragraph(value), ""]
            members = _unique(_members(value))
            if members:
                lines += ["| member | what it does |", "|---|---|"]
                lines += [f"| `{signature}` | {cell(text)} |" for signature, text in members]
                lines.append("")
        elif callable(value):
            lines += [f"### `{name}`", "", "```python", _signature(name, value), "```", ""]
            lines += [_first_paragraph(value), ""]
        else:
            constants.append(f"| `{name}` | `{value!r}` | {cell(comments.get(name, ''))} |")
    if constants:
        lines += ["### Constants", "", "| name | value | what it is |", "|---|---|---|", *constants, ""]
    return "\n".join(lines)


def stage_api_page() -> str:
    import pipeline.stage
    from pipeline.stage import api

    lines = [
        "# The Stage API",
        "",
        "A `model.py` whose class derives from `Stage` is served by the stage services' python backend",
        "([Python stages](../serving/python-stages.md)); it imports what it needs from `pipeline.stage`:",
        "",
        "```python",
        f"from pipeline.stage import {', '.join(pipeline.stage.__all__)}",
        "```",
        "",
        inspect.cleandoc(api.__doc__ or ""),
        "",
        "## `pipeline.stage`",
        "",
        module_reference(pipeline.stage),
        "### `Deadline`",
        "",
        _first_paragraph(api.Deadline),
        "",
        "| member | what it does |",
        "|---|---|",
        *(f"| `{signature}` | {cell(text)} |" for signature, text in _unique(_members(api.Deadline))),
    ]
    return header("`pipeline.stage`") + "\n".join(lines).rstrip() + "\n"


def pb_utils_page() -> str:
    from pipeline.stage import triton_python_backend_utils as pb_utils

    lines = [
        "# `triton_python_backend_utils`",
        "",
        "The part of Triton's Python backend API that a `model.py` written for Triton finds here, as",
        "`import triton_python_backend_utils as pb_utils` (the module is `pipeline.stage.triton_python_backend_utils`).",
        "A name not on this page is not provided: a model that uses it fails at load or at its first call with",
        "Python's own `AttributeError`. A name whose description says *Refused* exists, and raises",
        "`TritonModelException` saying why. See [Python stages](../serving/python-stages.md) and",
        "[Models that call models](../serving/bls.md).",
        "",
        "## What it covers",
        "",
        inspect.cleandoc(pb_utils.__doc__ or "").split("\n", 2)[2].strip(),
        "",
        "## Names",
        "",
        module_reference(pb_utils, reexports=True),
    ]
    return header("`pipeline.stage.triton_python_backend_utils`") + "\n".join(lines).rstrip() + "\n"


def python_client_page() -> str:
    from pipeline.tools import client

    lines = [
        "# The Python client",
        "",
        inspect.cleandoc(client.__doc__ or ""),
        "See [Clients](../clients/index.md#the-projects-python-client) for examples; any Open Inference",
        "Protocol or Triton client works as well.",
        "",
        "```python",
        "from pipeline.tools.client import InferenceClient",
        "```",
        "",
        module_reference(client),
    ]
    return header("`pipeline.tools.client`") + "\n".join(lines).rstrip() + "\n"

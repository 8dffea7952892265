"""The code's layout, as the developers' guide describes it: module names that say which module they are, and
modules, classes and functions small enough to hold one concept each."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pipeline

PACKAGE = Path(pipeline.__file__).parent


def test_no_two_modules_of_the_package_share_a_file_name() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "_gen" or path.name in ("__init__.py", "__main__.py"):
            continue
        where[path.name].append(str(relative))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, shared


#: The sizes past which a function, a class or a module holds more than one concept.
FUNCTION_LINES, CLASS_LINES, FILE_LINES = 60, 320, 600
#: The product's code: the library and the services (the generated protocol stubs aside).
ROOTS = (PACKAGE, PACKAGE.parent / "services")


def _product_files() -> list[Path]:
    return [path for root in ROOTS for path in root.rglob("*.py") if "_gen" not in path.parts]


def test_no_module_of_the_product_grows_past_its_size() -> None:
    over = []
    for path in _product_files():
        lines = len(path.read_text().splitlines())
        if lines > FILE_LINES:
            over.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert not over, over


def test_no_function_or_class_of_the_product_grows_past_its_size() -> None:
    over = []
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                limit = FUNCTION_LINES
            elif isinstance(node, ast.ClassDef):
                limit = CLASS_LINES
            else:
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                where = path.relative_to(PACKAGE.parent)
                over.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
    assert not over, over

"""The code's layout, as the developers' guide describes it: module names that say which module they are."""

from __future__ import annotations

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

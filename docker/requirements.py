"""Print the project's runtime requirements from pyproject.toml, one per line, split into groups.

The images install only what each service needs: `--exclude torch scikit-learn tqdm` gives what every
service shares (router, preprocess, postprocess), `--only torch` what the model service adds, and
`--only scikit-learn tqdm` what training adds, and `--extra gpu` an optional dependency group (the gpu
target's TensorRT). pyproject.toml stays the one list of dependencies.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pyproject", type=Path)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--only", nargs="+", default=None, help="print just these packages")
    group.add_argument("--exclude", nargs="+", default=None, help="print all but these packages")
    group.add_argument(
        "--extra", help="print this optional dependency group ([project.optional-dependencies])"
    )
    args = parser.parse_args()
    project = tomllib.loads(args.pyproject.read_text())["project"]
    if args.extra is not None:
        extras = project.get("optional-dependencies", {})
        if args.extra not in extras:
            raise SystemExit(
                f"requirements.py: pyproject.toml has no optional dependency group {args.extra!r}"
            )
        print("\n".join(extras[args.extra]))
        return
    dependencies = project["dependencies"]
    by_name = {canonical(re.split(r"[\s<>=!~;\[(]", dep, maxsplit=1)[0]): dep for dep in dependencies}
    if args.only is not None:
        wanted = [canonical(name) for name in args.only]
        missing = [name for name in wanted if name not in by_name]
        if missing:
            raise SystemExit(f"requirements.py: not in pyproject.toml's dependencies: {', '.join(missing)}")
        lines = [by_name[name] for name in wanted]
    else:
        excluded = {canonical(name) for name in args.exclude}
        lines = [dep for name, dep in by_name.items() if name not in excluded]
    print("\n".join(lines))


if __name__ == "__main__":
    main()

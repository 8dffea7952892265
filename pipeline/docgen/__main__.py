"""`python -m pipeline.docgen [--check]`: write the generated reference pages, or check that they are fresh."""

from __future__ import annotations

import argparse
import sys

import pipeline.docgen as docgen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.docgen", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed pages are stale")
    args = parser.parse_args(argv)
    if args.check:
        names = docgen.stale()
        if names:
            print(f"stale reference pages: {', '.join(names)}; run `make docs-reference`", file=sys.stderr)
            return 1
        return 0
    pages = docgen.generate()
    for name, content in pages.items():
        (docgen.OUT / name).write_text(content)
    print(f"wrote {len(pages)} pages to {docgen.OUT.relative_to(docgen.REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

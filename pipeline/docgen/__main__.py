"""`python -m pipeline.docgen [--check]`: write the generated reference pages, or check that they are fresh."""

from __future__ import annotations

import argparse
import sys
from typing import Annotated

from pydantic import BaseModel

import pipeline.docgen as docgen
from pipeline.runtime.settings_cli import add_arguments, option, process_settings


class Docgen(BaseModel):
    """Whether to write the pages or check them."""

    check: Annotated[
        bool, option("--check", action="store_true", help="fail if the committed pages are stale")
    ] = False


DocgenSettings = process_settings("DocgenSettings", (Docgen,))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.docgen", description=__doc__.split("\n")[0])
    add_arguments(parser, DocgenSettings)
    if DocgenSettings.parse(parser, argv).group(Docgen).check:
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

"""MkDocs hooks (mkdocs.yml `hooks:`): the site's Changelog page is the repository's CHANGELOG.md, read at
build time so it has one home, its links to docs/ pages made relative to the site."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """docs/changelog.md shows CHANGELOG.md."""
    if page.file.src_uri != "changelog.md":
        return markdown
    return re.sub(r"\]\(docs/", "](", CHANGELOG.read_text())

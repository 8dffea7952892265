"""Every picture the documentation shows is in the repository and was made by scripts/screenshots.sh (which
writes each picture's sha256 into docs/assets/screenshots/manifest.json), not pasted by hand; none is loaded
from elsewhere. The check reads files only: it needs neither Chromium nor Prometheus."""

import hashlib
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
SCREENSHOTS = DOCS / "assets" / "screenshots"
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)[^)]*\)|<img[^>]*\bsrc=\"([^\"]+)\"")


def _manifest() -> dict:
    return json.loads((SCREENSHOTS / "manifest.json").read_text())


def _referenced() -> dict[Path, set[str]]:
    """Each picture a page shows, resolved against the page: {file: the pages}."""
    found: dict[Path, set[str]] = {}
    for page in [REPO / "README.md", *DOCS.rglob("*.md")]:
        for match in _IMAGE.finditer(page.read_text()):
            target = match.group(1) or match.group(2)
            assert "://" not in target, f"{page.relative_to(REPO)} loads a picture from elsewhere: {target}"
            found.setdefault((page.parent / target).resolve(), set()).add(str(page.relative_to(REPO)))
    return found


def test_every_picture_a_page_shows_exists_and_was_made_by_the_script():
    manifest = _manifest()["pictures"]
    referenced = _referenced()
    assert referenced, "the pages show no picture"
    for path, pages in referenced.items():
        assert path.is_file(), f"{path.relative_to(REPO)}, shown by {sorted(pages)}, does not exist"
        assert path.parent == SCREENSHOTS, f"{path.relative_to(REPO)} is not one scripts/screenshots.sh makes"
        entry = manifest.get(path.name)
        assert entry is not None, f"{path.name} is not in the manifest: make it with scripts/screenshots.sh"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"], (
            f"{path.name} differs from what scripts/screenshots.sh made: run it again"
        )


def test_the_manifest_is_the_scripts_and_lists_only_pictures_it_makes():
    manifest = _manifest()
    assert manifest["made_by"] == "scripts/screenshots.sh"
    script = (REPO / manifest["made_by"]).read_text()
    for name, entry in manifest["pictures"].items():
        assert f'"{name}"' in script, f"scripts/screenshots.sh does not make {name}"
        assert (SCREENSHOTS / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{name} is not a PNG"
        assert entry["shows"]

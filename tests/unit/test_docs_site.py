"""The documentation site fetches nothing from elsewhere when it is viewed: no CDN, no web fonts; the
JavaScript it needs is served by the site itself, written by scripts/docs-assets.sh from a pinned npm package
(`make docs` runs it; once written, the build is offline)."""

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CDNS = ("unpkg.com", "cdn.jsdelivr.net", "cdnjs.cloudflare.com", "fonts.googleapis.com", "fonts.gstatic.com")


def _mkdocs() -> dict:
    # mkdocs.yml names a Python function for the Mermaid fence: read it as plain data.
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    return yaml.load((REPO / "mkdocs.yml").read_text(), Loader=Loader)


def test_the_theme_loads_no_web_font_and_the_scripts_are_the_sites_own():
    config = _mkdocs()
    assert config["theme"].get("font") is False, "Material fetches Google Fonts unless `font: false`"
    script = (REPO / "scripts" / "docs-assets.sh").read_text()
    for path in config.get("extra_javascript", []):
        assert "://" not in path, path
        assert f"docs/{path}" in script, f"{path} is not written by scripts/docs-assets.sh"
        assert f"docs/{path}" in (REPO / ".gitignore").read_text()
    assert "assets/javascripts/mermaid.min.js" in config["extra_javascript"]


def test_no_page_loads_anything_from_a_cdn():
    for path in [REPO / "mkdocs.yml", *(REPO / "docs").rglob("*.md"), *(REPO / "docs").rglob("*.html")]:
        text = path.read_text()
        for cdn in CDNS:
            assert cdn not in text, f"{path.relative_to(REPO)} names {cdn}"


def test_make_docs_writes_the_scripts_first():
    makefile = (REPO / "Makefile").read_text()
    [docs_rule] = [line for line in makefile.splitlines() if line.startswith("docs:")]
    assert "docs-assets" in docs_rule

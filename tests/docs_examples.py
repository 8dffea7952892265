"""The documentation's runnable examples: fenced blocks of README.md and docs/ that a test runs as written.

A block is runnable when the line before its fence is an HTML comment naming what it runs against:

    <!-- runnable: pipeline -->
    ```sh
    curl -s 127.0.0.1:8000/v2/models/digits_postprocess/infer -d '...'
    #> {"model_name":"digits_postprocess",…,"outputs":[{"name":"LABEL",…,"data":[3]},…]}
    ```

`pipeline` is the example pipeline started on ports the OS picks (`tests/e2e/test_docs_examples.py`);
`walkthrough` is the "serve your own repository" walkthrough (`tests/e2e/test_walkthrough.py`). Lines that
begin `#>` show a command's output, as reprex writes R's: in an `sh` block the output of the command lines
above them (up to the previous output), in a `python` block the script's whole output. They are comments,
so a block pastes into a shell or an interpreter as it is. The output shown must be the whole output, line
for line; `…` stands for any text within a line, and a line of `…` alone for any number of lines.
Commands that show no output are only required to succeed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The pages: the README and the documentation site's.
PAGES = (REPO / "README.md", REPO / "docs")
#: What a runnable block may run against, and the languages a test knows how to run.
FIXTURES = ("pipeline", "walkthrough")
LANGUAGES = ("sh", "python")
_MARKER = re.compile(r"^<!--\s*runnable(?::\s*(?P<fixture>[\w-]+))?\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>[\w-]*)\s*$")
OUTPUT = "#>"


@dataclass(frozen=True)
class Step:
    """Lines of a block to run, and the output shown after them (None: not shown, not checked)."""

    code: str
    output: tuple[str, ...] | None


@dataclass(frozen=True)
class Example:
    """One runnable block: where it is, what it needs, and its steps in order."""

    page: str
    line: int
    fixture: str
    language: str
    code: str
    steps: tuple[Step, ...]

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def output(self) -> tuple[str, ...] | None:
        """The whole output shown in the block (for a script run as one)."""
        shown = [step.output for step in self.steps if step.output is not None]
        return tuple(line for lines in shown for line in lines) if shown else None


class MarkerError(ValueError):
    """A runnable marker that does not mark a block this module can run."""


def parse(text: str, page: str) -> list[Example]:
    """The runnable blocks of one Markdown page."""
    lines = text.splitlines()
    examples = []
    for number, line in enumerate(lines):
        marker = _MARKER.match(line.strip())
        if marker is None:
            if line.strip().startswith("<!--") and "runnable" in line:
                raise MarkerError(f"{page}:{number + 1}: write the marker as <!-- runnable: FIXTURE -->")
            continue
        fixture = marker.group("fixture")
        fence = _FENCE.match(lines[number + 1]) if number + 1 < len(lines) else None
        if fence is None:
            raise MarkerError(f"{page}:{number + 1}: a runnable marker must be right above a fenced block")
        if fixture not in FIXTURES:
            raise MarkerError(
                f"{page}:{number + 1}: runnable against {fixture!r}; known: {', '.join(FIXTURES)}"
            )
        language = fence.group("language")
        if language not in LANGUAGES:
            raise MarkerError(f"{page}:{number + 1}: cannot run a {language or 'plain'} block")
        indent = len(fence.group("indent"))
        body = []
        for inner in lines[number + 2 :]:
            if inner.strip() == "```":
                break
            body.append(inner[indent:])
        else:
            raise MarkerError(f"{page}:{number + 1}: the block is never closed")
        code = "\n".join(body) + "\n"
        examples.append(Example(page, number + 2, fixture, language, code, steps(body)))
    return examples


def steps(body: list[str]) -> tuple[Step, ...]:
    """A block's lines cut after each run of output lines."""
    found: list[Step] = []
    code: list[str] = []
    output: list[str] = []
    for line in body:
        if line.startswith(OUTPUT):
            output.append(line[len(OUTPUT) :].removeprefix(" "))
            continue
        if output:
            found.append(Step("\n".join(code) + "\n", tuple(output)))
            code, output = [], []
        code.append(line)
    if code or output:
        found.append(Step("\n".join(code) + "\n", tuple(output) if output else None))
    return tuple(step for step in found if step.code.strip() or step.output)


def examples(fixture: str | None = None) -> list[Example]:
    """Every runnable block of the README and under docs/ (against `fixture`, where given), in page and line
    order."""
    readme, docs = PAGES
    found = []
    for path in [readme, *sorted(docs.rglob("*.md"))]:
        found += parse(path.read_text(), str(path.relative_to(REPO)))
    return [example for example in found if fixture is None or example.fixture == fixture]


def matches(shown: tuple[str, ...], actual: str) -> bool:
    """Whether the output shown stands for `actual`: line for line, `…` for any text, a lone `…` line for
    any lines. Trailing blanks and blank lines at either end do not count."""
    lines = [line.rstrip() for line in actual.strip("\n").splitlines()]
    pattern = "".join(
        r"(?:.*\n)*?" if line.strip() == "…" else ".*".join(map(re.escape, line.rstrip().split("…"))) + r"\n"
        for line in shown
    )
    return re.fullmatch(pattern, "\n".join(lines) + "\n") is not None

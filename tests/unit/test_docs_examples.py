"""The extractor of the documentation's runnable examples (`tests/docs_examples.py`): what it takes from a
page, how it compares an output, and that every runnable block under docs/ is one a test runs."""

import pytest

from tests.docs_examples import FIXTURES, MarkerError, examples, matches, parse

PAGE = """# A page

```sh
echo not runnable
```

<!-- runnable: pipeline -->
```sh
size=3   # a variable the next command reads
echo "$size apples"
#> 3 apples
echo done
```

- in a list:

  <!-- runnable: walkthrough -->
  ```python
  print("[[3]]", 0.25)
  #> [[3]] …
  ```
"""


def test_a_page_gives_its_marked_blocks_with_their_steps_and_outputs():
    shell, python = parse(PAGE, "page.md")
    assert (shell.name, shell.fixture, shell.language) == ("page.md:8", "pipeline", "sh")
    assert [step.output for step in shell.steps] == [("3 apples",), None]
    assert shell.steps[0].code == 'size=3   # a variable the next command reads\necho "$size apples"\n'
    assert shell.steps[1].code == "echo done\n"
    assert "#> 3 apples" in shell.code  # the block runs as written: output lines are comments
    assert (python.fixture, python.language, python.output) == ("walkthrough", "python", ("[[3]] …",))
    assert python.code.startswith('print("[[3]]", 0.25)\n')  # the list's indent is gone


@pytest.mark.parametrize(
    ("page", "error"),
    [
        ("<!-- runnable: nowhere -->\n```sh\ntrue\n```\n", "known: pipeline"),
        ("<!-- runnable: pipeline -->\n\n```sh\ntrue\n```\n", "right above a fenced block"),
        ("<!-- runnable: pipeline -->\n```yaml\na: 1\n```\n", "cannot run a yaml block"),
        ("<!-- runnable: pipeline -->\n```sh\ntrue\n", "never closed"),
        ("<!-- runnable pipeline -->\n```sh\ntrue\n```\n", "<!-- runnable: FIXTURE -->"),
    ],
)
def test_a_marker_that_marks_nothing_runnable_is_an_error(page, error):
    with pytest.raises(MarkerError, match=error):
        parse(page, "page.md")


@pytest.mark.parametrize(
    ("shown", "actual", "same"),
    [
        (("200",), "200\n", True),
        (("200",), "404\n", False),
        (("200",), "200\n200\n", False),  # the whole output, not a part of it
        (('{"data":[3],…}',), '{"data":[3],"shape":[1,1]}', True),
        (('{"data":[3],…}',), '{"data":[4],"shape":[1,1]}', False),
        (("first", "…", "last"), "first\na\nb\nlast\n", True),
        (("first", "…", "last"), "first\nlast\n", True),
        (("first", "…"), "first\n", True),
        (("first", "…", "last"), "first\na\n", False),
        (("a.b",), "axb\n", False),  # the rest is literal text
        (("line",), "\nline   \n\n", True),
    ],
)
def test_an_output_shown_stands_for_the_whole_output_with_ellipses(shown, actual, same):
    assert matches(shown, actual) is same


def test_every_runnable_block_of_the_docs_is_run_by_a_test():
    found = examples()  # raises on a marker that marks nothing runnable
    assert {example.fixture for example in found} == set(FIXTURES)
    assert {"README.md", "docs/getting-started.md", "docs/clients/http.md"} <= {e.page for e in found}
    walkthrough = examples("walkthrough")  # test_walkthrough's three blocks, on each page that shows them
    assert [(e.page, e.language) for e in walkthrough] == [
        (page, language)
        for page in ("README.md", "docs/serving/index.md")
        for language in ("sh", "sh", "python")
    ]
    assert len(examples("pipeline")) >= 5

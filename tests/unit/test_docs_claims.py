"""What the documentation names exists: every flag, environment variable, metric, repository path and module
that a page (README.md and docs/) names is found in the code or the repository. The generated reference
pages are left out: they are made from the code (`tests/unit/test_docgen.py` checks them).

A flag of another tool that a page names in a code span of its own (Triton's `--cache-config`) goes in
`FOREIGN_FLAGS`; a command line of another tool (`docker ...`, `curl ...`) is not checked."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

from pipeline import docgen

REPO = Path(__file__).resolve().parents[2]
#: Where the names a page may use are defined.
CODE = (
    "pipeline",
    "services",
    "bench",
    "examples",
    "scripts",
    "observability",
    "deploy",
    "docker",
    "front",
    "tests",
)
CODE_FILES = ("Makefile", "Dockerfile", "pyproject.toml", "compose.yaml", "compose.observability.yaml",
              "compose.swarm.yaml", "compose.gpu.yaml", "compose.torchserve.yaml")  # fmt: skip
#: Where the metrics are defined: the code that exports them.
METRICS_CODE = ("pipeline", "services")
#: Flags of other tools that pages name on their own, by tool.
FOREIGN_FLAGS = {
    "tritonserver": {
        "--cache-config", "--grpc-keepalive-permit-without-calls",
        "--grpc-http2-min-recv-ping-interval-without-data", "--help", "--model-repository",
        "--model-control-mode", "--load-model", "--strict-readiness", "--exit-on-error", "--http-port",
        "--grpc-port", "--metrics-port", "--log-verbose", "--disable-auto-complete-config",
        "--strict-model-config", "--backend-config", "--rate-limit", "--pinned-memory-pool-byte-size",
        "--cuda-memory-pool-byte-size", "--trace-config", "--allow-http", "--allow-grpc", "--allow-metrics",
        "--grpc-use-ssl", "--grpc-server-cert", "--grpc-server-key", "--grpc-root-cert", "--repository-poll-secs",
        "--exit-timeout-secs", "--id", "--log-info", "--log-warning", "--log-error", "--log-file",
        "--model-load-thread-count", "--buffer-manager-thread-count", "--http-thread-count",
        "--grpc-infer-allocation-pool-size", "--http-address", "--grpc-address", "--metrics-address",
        "--allow-cpu-metrics", "--allow-gpu-metrics", "--metrics-interval-ms", "--model-namespacing",
        "--response-cache-byte-size", "--model-config-name", "--grpc-restricted-protocol",
        "--http-restricted-api",
    },
    "mkdocs": {"--strict"},
    "docker": {"--build", "--profile", "--target", "--image", "--scale"},
    "curl": {"--data", "--data-binary", "--compressed"},
    "protoc": {"--cpp", "--grpc"},
    "jq": {"--arg", "--rawfile"},
}  # fmt: skip
#: Command lines of other tools, whose flags are theirs.
FOREIGN_COMMANDS = re.compile(
    r"^\s*(?:\$\s*)?(?:sudo\s+)?(?:docker|docker-compose|curl|jq|protoc|kubectl|tritonserver|perf_analyzer|"
    r"mkdocs|pip|npm|git|grpcurl|torchserve|torch-model-archiver|chromium|openssl|apt-get|helm|go|"
    r"prometheus|ghz|model-analyzer)\b"
)
_SPAN = re.compile(r"`([^`\n]+)`")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])")
_VARIABLE = re.compile(r"\b(PIPELINE_[A-Z0-9_]*[A-Z0-9]|[A-Z]+_ADDRESS)\b")
_METRIC = re.compile(r"\b((?:pipeline|nv)_[a-z0-9_]*[a-z0-9])\b")
_PATH = re.compile(r"(?<![\w/.$~-])([\w.-]+(?:/[\w.-]+)+/?)")
_MODULE = re.compile(r"(?:pipeline|services|bench|examples|tests)(?:\.\w+)+")
#: Folders users do not write into: a path under them that a command line names must exist.
_READ_ONLY = (
    "pipeline",
    "services",
    "scripts",
    "bench",
    "tests",
    "protos",
    "deploy",
    "observability",
    "docs",
)


def pages() -> list[Path]:
    generated = {docgen.OUT / name for name in docgen.generate()}
    return [REPO / "README.md", *(p for p in sorted((REPO / "docs").rglob("*.md")) if p not in generated)]


@cache
def _text(folders: tuple[str, ...], files: tuple[str, ...] = ()) -> str:
    found = [REPO / name for name in files]
    for folder in folders:
        found += [p for p in (REPO / folder).rglob("*") if p.is_file() and "_gen" not in p.parts]
    texts = []
    for path in found:
        try:
            texts.append(path.read_text())
        except (UnicodeDecodeError, OSError):
            continue
    return "\n".join(texts)


def _code() -> str:
    return _text(CODE, CODE_FILES)


def _chunks(text: str) -> list[str]:
    """Inline code spans outside fences, and each line of the fences."""
    spans = _SPAN.findall(_FENCE.sub("", text))
    return spans + [line for fence in _FENCE.findall(text) for line in fence.splitlines()[1:-1]]


def _ignored(path: str) -> bool:
    """A path git ignores: a file the project writes (`make model`, a build)."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0


def _missing(kind: str, found: dict[str, set[str]]) -> str:
    return "\n".join(
        f"{kind} {name}: named by {', '.join(sorted(where))}" for name, where in sorted(found.items())
    )


def test_every_flag_a_page_names_exists():
    ours = set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", _code()))
    foreign = set().union(*FOREIGN_FLAGS.values())
    missing: dict[str, set[str]] = {}
    for page in pages():
        for chunk in _chunks(page.read_text()):
            if FOREIGN_COMMANDS.match(chunk):
                continue
            for flag in _FLAG.findall(chunk):
                if flag not in ours and flag not in foreign:
                    missing.setdefault(flag, set()).add(str(page.relative_to(REPO)))
    assert not missing, "flags no parser defines (another tool's: add it to FOREIGN_FLAGS)\n" + _missing(
        "flag", missing
    )


def test_every_environment_variable_a_page_names_exists():
    known = docgen.settings_table().keys() | docgen.variables(list(docgen.commands())).keys()
    code = _code()
    missing: dict[str, set[str]] = {}
    for page in pages():
        for name in _VARIABLE.findall(page.read_text()):
            if name not in known and name not in code:
                missing.setdefault(name, set()).add(str(page.relative_to(REPO)))
    assert not missing, _missing("variable", missing)


def test_every_metric_a_page_names_is_exported():
    code = _text(METRICS_CODE)
    missing: dict[str, set[str]] = {}
    for page in pages():
        for chunk in _chunks(page.read_text()):
            if FOREIGN_COMMANDS.match(chunk):
                continue
            for name in _METRIC.findall(chunk):
                if re.sub(r"_(bucket|sum|count|total)$", "", name) not in code:
                    missing.setdefault(name, set()).add(str(page.relative_to(REPO)))
    assert not missing, _missing("metric", missing)


def test_every_repository_path_a_page_names_exists():
    top = {path.name for path in REPO.iterdir()}
    missing: dict[str, set[str]] = {}
    for page in pages():
        text = page.read_text()
        spans = [s.strip() for s in _SPAN.findall(_FENCE.sub("", text))]
        named = [s for s in spans if re.fullmatch(r"[\w.-]+(?:/[\w.-]*)+", s) and s.split("/")[0] in top]
        for fence in _FENCE.findall(text):
            named += [p for p in _PATH.findall(fence) if p.split("/")[0] in _READ_ONLY]
        for path in named:
            if not (REPO / path).exists() and not _ignored(path):
                missing.setdefault(path, set()).add(str(page.relative_to(REPO)))
    assert not missing, _missing("path", missing)


def test_every_module_a_page_names_exists():
    code = _code()
    missing: dict[str, set[str]] = {}
    for page in pages():
        for name in _MODULE.findall(" ".join(_SPAN.findall(page.read_text()))):
            if (
                not _module_exists(name) and name not in code
            ):  # a parameter or span attribute: `pipeline.step`
                missing.setdefault(name, set()).add(str(page.relative_to(REPO)))
    assert not missing, _missing("module", missing)


def _module_exists(name: str) -> bool:
    """`a.b.c` is a module, or a module's attribute its source names; `services.md` a file."""
    if (REPO / name).is_file():
        return True
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:end])
        for source in (base.with_suffix(".py"), base / "__init__.py"):
            if source.is_file():
                text = source.read_text()
                return all(re.search(rf"\b{re.escape(part)}\b", text) for part in parts[end:])
    return False

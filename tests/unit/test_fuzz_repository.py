"""Fuzzing the model repository reader and the config.pbtxt ensemble compiler: random and mutated
`config.pbtxt` texts in random repository layouts (version folders, model files, links that leave the
repository, files where folders belong).

Every case reads, or fails with `RepositoryError` / `ConfigError` naming what was wrong; nothing else may
escape, nothing may hang. `PIPELINE_FUZZ_EXAMPLES` raises the count (`make fuzz`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.ensemble.pbtxt import compile_model_config, load_repository_ensembles
from pipeline.protocol.errors import ConfigError, RepositoryError
from pipeline.protocol.model_config import parse_config, select_versions, tensor_specs
from pipeline.runtime.repository import ModelRepository, RepositoryEntry

EXAMPLES = int(os.environ.get("PIPELINE_FUZZ_EXAMPLES", "200"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

ENSEMBLE = """\
name: "ens"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IMAGE", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "LABEL", data_type: TYPE_INT64, dims: [ 1 ] }, { name: "SCORES", data_type: TYPE_FP32, dims: [ 10 ] } ]
ensemble_scheduling {
  step [
    { model_name: "pre" model_version: -1 input_map { key: "IMAGE" value: "IMAGE" } output_map { key: "PIXELS" value: "pixels" } },
    { model_name: "cnn" model_version: 2 input_map { key: "INPUT" value: "pixels" } output_map { key: "LOGITS" value: "logits" } },
    { model_name: "post" input_map { key: "LOGITS" value: "logits" }
      output_map { key: "LABEL" value: "LABEL" } output_map { key: "SCORES" value: "SCORES" } }
  ]
}
"""
PYTHON_MODEL = """\
name: "pre"
backend: "python"
max_batch_size: 64
input [ { name: "IMAGE" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "PIXELS" data_type: TYPE_FP32 dims: [ 1, 8, 8 ] } ]
parameters { key: "max_image_pixels" value { string_value: "16000000" } }
instance_group [ { count: 2 kind: KIND_CPU } ]
version_policy { specific { versions: [ 1, 3 ] } }
dynamic_batching { max_queue_delay_microseconds: 100 preferred_batch_size: [ 4, 8 ] }
"""
TOKENS = [
    "{", "}", "[", "]", ":", ",", '"', "\n", " ", "-1", "0", "2", "99999999999999999999", "1e400", "-",
    "name", "platform", "backend", "max_batch_size", "input", "output", "dims", "data_type", "TYPE_FP32",
    "TYPE_STRING", "TYPE_INVALID", "ensemble", "ensemble_scheduling", "step", "model_name", "model_version",
    "input_map", "output_map", "key", "value", "version_policy", "latest", "all", "specific", "versions",
    "num_versions", "instance_group", "count", "parameters", "string_value", "default_model_filename",
    '"ensemble"', '"python"', '"onnxruntime_onnx"', '"no_such_platform"', '"../x"', '"\\xff"', "#", "<", ">",
]  # fmt: skip

#: Names in a model folder: versions good and bad, model files, and the odd file.
CHILDREN = ["1", "2", "3", "0", "01", "-1", "x", "99999999999999999999", ".hidden", "config.pbtxt"]
FILES = ["model.py", "model.onnx", "model.pt", "model.pt2", "model.plan", "weights.bin", "model.unknown"]
MODEL_NAMES = ["ens", "pre", "cnn", "post", "a.b", "-x", ".x", "x y", "é"]


@st.composite
def mutated(draw: st.DrawFn, base: str) -> str:
    text = base
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(0, len(text)))
        kind = draw(st.sampled_from(["delete", "insert", "duplicate", "replace"]))
        if kind == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 40)) :]
        elif kind == "insert":
            text = text[:at] + draw(st.sampled_from(TOKENS) | st.text(max_size=6)) + text[at:]
        elif kind == "duplicate":
            end = min(len(text), at + draw(st.integers(1, 80)))
            text = text[:end] + text[at:end] + text[end:]
        else:
            text = text[:at] + draw(st.sampled_from(TOKENS)) + text[at + 1 :]
    return text


config_texts = (
    mutated(ENSEMBLE)
    | mutated(PYTHON_MODEL)
    | st.lists(st.sampled_from(TOKENS), max_size=40).map(" ".join)
    | st.text(max_size=200)
)
config_bytes = config_texts.map(lambda t: t.encode("utf-8", "surrogatepass")) | st.binary(max_size=200)


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, tuple[bytes | None, list[tuple[str, str | None]]]]:
    """Model folder name -> (config.pbtxt bytes or None, [(child name, file in it or None)])."""
    models = {}
    for name in draw(st.lists(st.sampled_from(MODEL_NAMES), min_size=1, max_size=4, unique=True)):
        config = draw(st.none() | config_bytes)
        children = draw(
            st.lists(st.tuples(st.sampled_from(CHILDREN), st.none() | st.sampled_from(FILES)), max_size=3)
        )
        models[name] = (config, children)
    return models


def _write(root: Path, layout, outside: Path, link: bool) -> None:
    for name, (config, children) in layout.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        if config is not None:
            (folder / "config.pbtxt").write_bytes(config)
        for child, file in children:
            path = folder / child
            if path.exists():
                continue
            if child == "config.pbtxt" or (file == "weights.bin" and child == "2"):
                path.write_bytes(b"a file where a folder belongs")
                continue
            path.mkdir()
            if file is not None:
                (path / file).write_bytes(b"not a model")
    if link:
        # A model folder and a version that lead outside the repository.
        (root / "escape").symlink_to(outside, target_is_directory=True)
        first = next(iter(layout))
        if (root / first).is_dir() and not (root / first / "4").exists():
            (root / first / "4").symlink_to(outside, target_is_directory=True)


def _only_repository_errors(entry: RepositoryEntry) -> None:
    try:
        tensor_specs(entry.config, entry.source)
        select_versions(entry.config.version_policy, entry.versions, entry.source)
        for version in entry.served_versions():
            entry.artifact(version)
    except RepositoryError as exc:
        assert exc.message


def _read_everything(root: Path) -> None:
    repository = ModelRepository(root)
    for name, entry in repository.entries(
        {"ensemble", "python", "onnxruntime", "pytorch", "tensorrt", "torch_export"}
    ).items():
        if isinstance(entry, RepositoryError):
            assert entry.message, name
            continue
        _only_repository_errors(entry)
        if entry.backend == "ensemble":
            try:
                compile_model_config(entry.config, entry.source)
            except ConfigError as exc:
                assert str(exc)
    try:
        load_repository_ensembles(root)
    except ConfigError as exc:
        assert str(exc)


@SETTINGS
@given(text=config_texts)
def test_config_pbtxt_parses_or_fails_with_a_repository_error(text: str) -> None:
    try:
        config = parse_config(text, "config.pbtxt")
    except RepositoryError as exc:
        assert exc.message.startswith("config.pbtxt")
        return
    try:
        tensor_specs(config, "config.pbtxt")
    except RepositoryError as exc:
        assert "config.pbtxt" in exc.message
    if config.platform == "ensemble" or config.HasField("ensemble_scheduling"):
        try:
            compile_model_config(config, "config.pbtxt")
        except ConfigError as exc:
            assert "config.pbtxt" in str(exc)


@SETTINGS
@given(layout=layouts(), link=st.booleans())
def test_repository_layouts_read_or_fail_with_a_repository_error(layout, link: bool) -> None:
    base = Path(tempfile.mkdtemp(prefix="fuzz-repository-"))
    try:
        outside = base / "outside"
        (outside / "1").mkdir(parents=True)
        (outside / "config.pbtxt").write_text('backend: "python"')
        (outside / "1" / "model.py").write_text("raise SystemExit('read from outside the repository')")
        root = base / "models"
        _write(root, layout, outside, link)
        logging.disable(logging.WARNING)  # skipped entries are logged: thousands of lines otherwise
        try:
            _read_everything(root)
        finally:
            logging.disable(logging.NOTSET)
    finally:
        shutil.rmtree(base, ignore_errors=True)

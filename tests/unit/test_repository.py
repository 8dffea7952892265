"""Reading a Triton model repository: config.pbtxt, backends, versions and confinement (no sockets)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import RepositoryError, RepositoryNotFound
from pipeline.protocol.model_config import config_text, parse_config, select_versions, tensor_specs
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.repository import ModelRepository

CONFIG = """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 3, -1 ] optional: true } ]
output [ { name: "Y" data_type: TYPE_STRING dims: [ 1 ] } ]
version_policy { specific { versions: [ 1, 3 ] } }
parameters { key: "pad_value.X" value { string_value: "0.5" } }
"""


def model(root: Path, name: str, config: str | None, versions: dict[str, list[str]]) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    for version, files in versions.items():
        (folder / version).mkdir()
        for file in files:
            (folder / version / file).write_bytes(b"")
    return folder


def test_a_config_reads_into_triton_fields_and_back() -> None:
    config = parse_config(CONFIG, "config.pbtxt")
    assert config.max_batch_size == 8 and config.input[0].optional
    assert list(config.version_policy.specific.versions) == [1, 3]
    assert parse_config(config_text(config), "again") == config
    inputs, outputs = tensor_specs(config)
    assert inputs == (TensorSpec("X", "FP32", (-1, 3, -1), pad_value=0.5, optional=True),)
    assert outputs == (TensorSpec("Y", "BYTES", (-1, 1)),)


@pytest.mark.parametrize(
    ("text", "where", "cause"),
    [
        ('name: "m"\n  max_batch_size: 8\nbogus: 1\n', "line 3", 'has no field named "bogus"'),
        ('name: "m"\ninput [ { name: "X" data_type: TYPE_FLOAT } ]\n', "line 2", "TYPE_FLOAT"),
        ("max_batch_size: 8\ninput [ { name: \n", "line 3", ""),
    ],
)
def test_a_bad_config_names_the_file_the_line_and_the_cause(text: str, where: str, cause: str) -> None:
    with pytest.raises(RepositoryError) as error:
        parse_config(text, "repo/m/config.pbtxt")
    assert error.value.message.startswith(f"repo/m/config.pbtxt: {where}")
    assert cause in error.value.message


def test_the_backend_comes_from_the_config_or_the_artifact(tmp_path: Path) -> None:
    model(tmp_path, "by_platform", 'platform: "pytorch_libtorch"', {"1": ["model.pt"]})
    model(tmp_path, "by_backend", 'backend: "onnxruntime"', {"1": ["model.onnx"]})
    model(tmp_path, "by_file", None, {"1": ["model.plan"], "2": ["model.pt2"]})
    model(tmp_path, "stage", None, {"1": ["model.py"]})
    model(tmp_path, "ensemble", 'platform: "ensemble"', {})
    model(tmp_path, "not_a_model", None, {})  # no config, no version: not listed
    repository = ModelRepository(tmp_path)
    assert repository.names() == ["by_backend", "by_file", "by_platform", "ensemble", "stage"]
    backends = {name: repository.read(name).backend for name in repository.names()}
    assert backends == {
        "by_backend": "onnxruntime",
        "by_file": "pytorch",  # the newest version's artifact
        "by_platform": "pytorch",
        "ensemble": "ensemble",
        "stage": "python",
    }
    entries = repository.entries({"python", "onnxruntime"})
    assert sorted(entries) == ["by_backend", "stage"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('platform: "tensorflow_savedmodel"', "unknown platform 'tensorflow_savedmodel'"),
        ('backend: "fancy"', "unknown backend 'fancy'"),
        ('platform: "onnxruntime_onnx" backend: "pytorch"', "disagree"),
        ('name: "other"', "differs from the folder's name 'm'"),
        ("max_batch_size: 4", "names no platform or backend"),
    ],
)
def test_an_entry_that_cannot_be_served_says_why(tmp_path: Path, config: str, message: str) -> None:
    model(tmp_path, "m", config, {"1": ["weights.bin"]})
    with pytest.raises(RepositoryError, match=message):
        ModelRepository(tmp_path).read("m")


def test_versions_follow_the_policy_and_missing_ones_are_not_found(tmp_path: Path) -> None:
    model(tmp_path, "m", CONFIG, {"1": ["model.onnx"], "2": ["model.onnx"], "3": ["model.onnx"]})
    entry = ModelRepository(tmp_path).read("m")
    assert entry.versions == ("1", "2", "3") and entry.served_versions() == ["1", "3"]
    policy = mc.ModelVersionPolicy()
    assert select_versions(policy, ["1", "10", "2"], "s") == ["10"]  # numeric order, newest alone
    policy.latest.num_versions = 2
    assert select_versions(policy, ["1", "10", "2"], "s") == ["2", "10"]
    policy.all.SetInParent()
    assert select_versions(policy, ["2", "1"], "s") == ["1", "2"]
    policy.specific.versions.append(7)
    with pytest.raises(RepositoryNotFound, match="version_policy names version"):
        select_versions(policy, ["1"], "s")
    with pytest.raises(RepositoryNotFound, match="has no version '9'"):
        entry.version_dir("9")
    with pytest.raises(RepositoryNotFound, match="no folder"):
        ModelRepository(tmp_path).read("absent")


def test_paths_never_leave_the_repository(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.onnx").write_bytes(b"")
    root = tmp_path / "repo"
    folder = model(root, "m", 'platform: "onnxruntime_onnx"', {"1": []})
    os.symlink(outside / "model.onnx", folder / "1" / "model.onnx")
    repository = ModelRepository(root)
    with pytest.raises(RepositoryError, match="leads outside the repository"):
        repository.read("m").artifact("1")
    (folder / "config.pbtxt").write_text('platform: "onnxruntime_onnx" default_model_filename: "../../x"')
    with pytest.raises(RepositoryError, match="not a plain file name"):
        repository.read("m").artifact("1")
    for name in ("../outside", ".hidden", "a/b"):
        with pytest.raises(RepositoryError, match="not a plain name"):
            repository.read(name)
    os.symlink(outside, root / "linked")
    with pytest.raises(RepositoryError, match="leads outside the repository"):
        repository.read("linked")

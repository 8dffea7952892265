"""The repository's layout, config files, version policies and their errors: each one says what and where."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from services.model.digits import train
from services.model.repository import (
    CONFIG_FILE,
    ModelRepository,
    RepositoryError,
    check_repository,
    parse_config,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    train(root, epochs=1, progress=False)
    return root


def make_model(root: Path, versions: tuple[str, ...], config: dict | str | None, trained: Path) -> Path:
    folder = root / "digits_cnn"
    folder.mkdir(parents=True)
    if config is not None:
        (folder / CONFIG_FILE).write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    for version in versions:
        (folder / version).mkdir()
        (folder / version / "model.pt").write_bytes((trained / "digits_cnn" / "1" / "model.pt").read_bytes())
    return folder


def test_train_writes_a_config_and_the_repository_reads_it(trained: Path) -> None:
    config = yaml.safe_load((trained / "digits_cnn" / CONFIG_FILE).read_text())
    assert config["architecture"] == "digits_cnn"
    repo = ModelRepository(trained)
    assert repo.names() == ["digits_cnn", "minilm_encoder", "refcnn_cnn"]
    entry = repo.read("digits_cnn")
    assert entry.versions == ("1",) and entry.served_versions() == ["1"]
    assert entry.max_batch_size == 256 and entry.config.precision == "fp32"


def test_builtins_need_no_folder(tmp_path: Path) -> None:
    repo = ModelRepository(tmp_path / "absent")
    refcnn = repo.read("refcnn_cnn")
    assert refcnn.implicit and refcnn.served_versions() == ["1"] and refcnn.version_dir("1") is None
    assert repo.read("minilm_encoder").network.architecture == "minilm"
    # A folder gives a built-in its settings.
    (tmp_path / "refcnn_cnn").mkdir()
    (tmp_path / "refcnn_cnn" / CONFIG_FILE).write_text("max_batch_size: 32\ninstance_group: [{count: 2}]\n")
    entry = ModelRepository(tmp_path).read("refcnn_cnn")
    assert entry.max_batch_size == 32 and entry.config.instance_group[0].count == 2 and entry.implicit


def test_digits_without_a_config_gets_the_default(tmp_path: Path, trained: Path) -> None:
    make_model(tmp_path, ("1",), None, trained)
    assert ModelRepository(tmp_path).read("digits_cnn").config.architecture == "digits_cnn"


def test_missing_versions(tmp_path: Path, trained: Path) -> None:
    make_model(tmp_path, (), {"architecture": "digits_cnn"}, trained)
    (tmp_path / "digits_cnn" / "notes").mkdir()  # not a version: ignored, as Triton does
    with pytest.raises(RepositoryError, match=r"no version folders in .*digits_cnn") as caught:
        ModelRepository(tmp_path).read("digits_cnn").served_versions()
    assert caught.value.code.name == "INVALID_ARGUMENT"


def test_a_version_folder_without_weights(tmp_path: Path, trained: Path) -> None:
    folder = make_model(tmp_path, ("1",), {"architecture": "digits_cnn"}, trained)
    (folder / "2").mkdir()
    with pytest.raises(RepositoryError, match=r"version 2: weights file .*2/model.pt is missing.*make model"):
        ModelRepository(tmp_path).read("digits_cnn").served_versions()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file, so unreadable weights cannot be made")
def test_unreadable_weights(tmp_path: Path, trained: Path) -> None:
    folder = make_model(tmp_path, ("1",), {"architecture": "digits_cnn"}, trained)
    (folder / "1" / "model.pt").chmod(0)
    with pytest.raises(RepositoryError, match="cannot read"):
        ModelRepository(tmp_path).read("digits_cnn").served_versions()


def test_corrupt_weights_fail_at_load_naming_the_file(tmp_path: Path, trained: Path) -> None:
    from services.model.backends import ModelLoadError, TorchRunner

    folder = make_model(tmp_path, ("1",), {"architecture": "digits_cnn"}, trained)
    (folder / "1" / "model.pt").write_bytes(b"garbage")
    entry = ModelRepository(tmp_path).read("digits_cnn")
    runner = TorchRunner(entry.network, entry.version_dir("1"))
    with pytest.raises(ModelLoadError, match=r"cannot read model weights .*1/model.pt"):
        runner.load()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("architecture: [unclosed", "not valid YAML"),
        ("- a list", "must be a mapping"),
        ({"architecture": "resnet"}, "unknown architecture 'resnet'"),
        ({"architecture": "digits_cnn", "backend": "onnx"}, "backend: Input should be"),
        ({"architecture": "digits_cnn", "precision": "int8"}, "precision"),
        ({"architecture": "digits_cnn", "max_batch_size": 0}, "max_batch_size"),
        ({"architecture": "digits_cnn", "max_batch_size": 1000}, "over digits_cnn's 256"),
        ({"architecture": "digits_cnn", "colour": "red"}, "colour: Extra inputs are not permitted"),
        ({"architecture": "digits_cnn", "instance_group": [{"count": 0}]}, "instance_group.0.count"),
        ({"architecture": "digits_cnn", "version_policy": {"latest": {}, "all": {}}}, "give one of"),
        ({"architecture": "digits_cnn", "torch": {"mode": "fast"}}, "torch.mode"),
    ],
)
def test_bad_configs_name_the_file_and_the_key(
    tmp_path: Path, trained: Path, config: dict | str, message: str
) -> None:
    make_model(tmp_path, ("1",), config, trained)
    with pytest.raises(RepositoryError) as caught:
        ModelRepository(tmp_path).read("digits_cnn")
    text = str(caught.value)
    assert message in text and str(tmp_path / "digits_cnn" / CONFIG_FILE) in text, text


def test_a_folder_without_config_that_is_not_builtin(tmp_path: Path) -> None:
    (tmp_path / "mystery" / "1").mkdir(parents=True)
    repo = ModelRepository(tmp_path)
    assert "mystery" not in repo.names()  # not a model: no config.yaml
    with pytest.raises(RepositoryError, match=r"mystery/config.yaml is missing"):
        repo.read("mystery")
    with pytest.raises(RepositoryError, match="no folder"):
        repo.read("absent")


@pytest.mark.parametrize(
    ("policy", "served"),
    [
        (None, ["3"]),
        ({"latest": {"num_versions": 2}}, ["2", "3"]),
        ({"all": {}}, ["1", "2", "3"]),
        ({"specific": {"versions": [1, 3]}}, ["1", "3"]),
    ],
)
def test_version_policies(tmp_path: Path, trained: Path, policy: dict | None, served: list[str]) -> None:
    config: dict = {"architecture": "digits_cnn"}
    if policy is not None:
        config["version_policy"] = policy
    make_model(tmp_path, ("1", "2", "3"), config, trained)
    assert ModelRepository(tmp_path).read("digits_cnn").served_versions() == served


def test_versions_sort_as_numbers(tmp_path: Path, trained: Path) -> None:
    make_model(tmp_path, ("2", "10"), {"architecture": "digits_cnn"}, trained)
    entry = ModelRepository(tmp_path).read("digits_cnn")
    assert entry.versions == ("2", "10") and entry.served_versions() == ["10"]


def test_a_policy_naming_a_missing_version(tmp_path: Path, trained: Path) -> None:
    config = {"architecture": "digits_cnn", "version_policy": {"specific": {"versions": [4]}}}
    make_model(tmp_path, ("1",), config, trained)
    with pytest.raises(RepositoryError, match=r"names version\(s\) 4, which have no folder \(found: 1\)"):
        ModelRepository(tmp_path).read("digits_cnn").served_versions()


def test_override_wins_over_the_file() -> None:
    config = parse_config("digits_cnn", "precision: fp32\n", source="x", override={"precision": "fp16"})
    assert config.precision == "fp16"


def test_check_repository_fails_early(tmp_path: Path, trained: Path) -> None:
    from services.model.backends import BackendUnavailable

    check_repository(ModelRepository(trained), "auto", "cpu")
    with pytest.raises(RepositoryError, match="digits_cnn"):
        check_repository(ModelRepository(tmp_path), "auto", "cpu")  # no digits folder: train it
    with pytest.raises(BackendUnavailable, match="needs a GPU instance"):
        check_repository(ModelRepository(trained), "tensorrt", "cpu")

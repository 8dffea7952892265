"""What an archive may ask of the server besides its handler file: a `requirements.txt` (refused unless
config.properties sets TorchServe's `install_py_dep_per_model=true`, then installed by pip into a folder the
handler finds on its path) and TorchServe's built-in handlers by name (refused, naming the package they would
need where it is missing). The install is checked offline: a wheel made here, pip told to look only there."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

import pytest
from google.protobuf import json_format

from pipeline.protocol.errors import ConfigError
from pipeline.runtime.torchserve_store import model_config, pack, read_model, unpack
from pipeline.stage.torchserve.handler_model import TritonPythonModel
from pipeline.tools.model_store import LauncherModelStore, main, write_store_models
from tests.torchserve.archive import archive_with_zipfile

#: A handler that answers with a value of the package its requirements.txt names.
DEPENDENT_HANDLER = """\
import tinydep


def handle(data, context):
    if data is None:
        return None
    return [{"value": tinydep.VALUE} for _ in data]
"""


def _wheel(folder: Path) -> Path:
    """A pure-Python wheel of the package `tinydep` 0.1 (one module: VALUE = 42), written by hand."""
    files = {
        "tinydep.py": b"VALUE = 42\n",
        "tinydep-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinydep\nVersion: 0.1\n",
        "tinydep-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for name, data in files.items()
    ]
    files["tinydep-0.1.dist-info/RECORD"] = (
        "\n".join([*record, "tinydep-0.1.dist-info/RECORD,,"]) + "\n"
    ).encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tinydep-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


@pytest.fixture
def dependent_store(tmp_path: Path) -> Path:
    """A store whose archive `dep.mar` has a requirements.txt naming tinydep."""
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "dep_handler.py").write_text(DEPENDENT_HANDLER)
    (sources / "requirements.txt").write_text("tinydep==0.1\n")
    store = tmp_path / "store"
    archive_with_zipfile(store, "dep", sources / "dep_handler.py", (sources / "requirements.txt",))
    return store


def _args(store: Path, models: str, properties: Path | None = None) -> LauncherModelStore:
    return LauncherModelStore(model_store=store, models=models, ts_config=properties)


def test_a_requirements_file_is_refused_without_install_py_dep_per_model(
    dependent_store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    repository = tmp_path / "models"
    with pytest.raises(ConfigError, match="install_py_dep_per_model=true"):
        write_store_models(_args(dependent_store, "dep.mar"), repository)
    properties = tmp_path / "config.properties"
    properties.write_text("install_py_dep_per_model=false\n")
    flags = [
        "--model-store",
        str(dependent_store),
        "--model-dir",
        str(repository),
        "--ts-config",
        str(properties),
    ]
    assert main([*flags, "--models", "dep.mar"]) == 2
    assert "dep.mar: the archive has a requirements.txt" in caplog.text
    assert not repository.exists() or list(repository.iterdir()) == []


def test_a_requirements_file_is_installed_where_config_properties_asks(
    dependent_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip installs it (offline: only the wheel made here) into a folder of the repository, which the model's
    config names; the handler, loaded as the model service loads it, imports the package and answers."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(_wheel(tmp_path / "wheels").parent))
    properties = tmp_path / "config.properties"
    properties.write_text("install_py_dep_per_model=true\n")
    repository = tmp_path / "models"
    (archive,) = write_store_models(_args(dependent_store, "dep.mar", properties), repository)
    installed = Path(archive.dependencies)
    assert (installed / "tinydep.py").is_file() and installed.is_relative_to(repository)
    model = read_model(repository, "dep")
    assert model is not None and model.dependencies == str(installed)
    config = json_format.MessageToDict(model_config(model), preserving_proto_field_name=True)
    handler = TritonPythonModel()
    monkeypatch.setattr(sys, "path", list(sys.path))  # the model adds the folder to the path
    handler.initialize({"model_config": json.dumps(config), "model_name": "dep"})
    try:
        request = pack({"headers": {}, "parameters": [["body", "text/plain"]]}, [b"hi"])
        (answer,) = handler.service.predict([request])
        meta, (body,) = unpack(answer)
        assert meta["status"] == 200 and json.loads(body) == {"value": 42}
    finally:
        handler.finalize()


def test_a_pip_failure_is_named(
    dependent_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    properties = tmp_path / "config.properties"
    properties.write_text("install_py_dep_per_model=true\n")
    with pytest.raises(
        ConfigError, match=re.escape("model 'dep' (dep.mar): pip could not install its requirements.txt")
    ):
        write_store_models(_args(dependent_store, "dep.mar", properties), tmp_path / "models")


def test_torchserves_built_in_handlers_are_refused_naming_what_they_need(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    manifest = {
        "runtime": "python",
        "model": {"modelName": "resnet", "handler": "image_classifier", "modelVersion": "1.0"},
    }
    with zipfile.ZipFile(store / "resnet.mar", "w") as mar:
        mar.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest))
        mar.writestr("model.pt", b"weights")
    with pytest.raises(ConfigError) as refused:
        write_store_models(_args(store, "resnet.mar"), tmp_path / "models")
    message = str(refused.value)
    assert "handler 'image_classifier' is TorchServe's built-in image classifier" in message
    assert "needs torchvision" in message  # not installed with the project
    assert "torch-model-archiver --handler" in message

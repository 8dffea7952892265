"""A TorchServe model store written into a model repository: by `pipeline run --model-store` (a folder of its
own) and by `python -m pipeline.tools.model_store` (the one-shot of compose.torchserve.yaml, into the
repository every service mounts): the archives named get their folders, those no longer named lose theirs,
the repository's other models stay, and a store or an archive that is not there stops it with a message
naming it (exit code 2), nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.runtime.torchserve_store import archive_models
from pipeline.tools.model_store import main
from tests.torchserve.archive import archive_with_zipfile

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    folder = tmp_path / "store"
    archive_with_zipfile(folder)
    archive_with_zipfile(folder, "more")
    return folder


def served(repository: Path) -> dict[str, str]:
    return {model.name: model.url for model in archive_models(repository)}


def test_the_archives_named_are_written_and_those_no_longer_named_removed(
    store: Path, tmp_path: Path
) -> None:
    repository = tmp_path / "models"
    (repository / "other" / "1").mkdir(parents=True)
    (repository / "other" / "config.pbtxt").write_text('name: "other"\nbackend: "python"\n')
    assert main(["--model-store", str(store), "--models", "all", "--model-dir", str(repository)]) == 0
    assert served(repository) == {"more": "more.mar", "words": "words.mar"}
    assert (repository / "words" / "1" / "model.py").is_file()
    assert main(["--model-store", str(store), "--models", "w=words.mar", "--model-dir", str(repository)]) == 0
    assert served(repository) == {"w": "words.mar"}
    assert sorted(p.name for p in repository.iterdir()) == ["other", "w"]  # another model stays


def test_the_store_is_read_from_the_environment_as_compose_gives_it(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repository = tmp_path / "models"
    repository.mkdir()
    monkeypatch.setenv("PIPELINE_MODEL_STORE", str(store))
    monkeypatch.setenv("PIPELINE_MODELS", "words.mar")
    monkeypatch.setenv("PIPELINE_MODEL_DIR", str(repository))
    assert main([]) == 0
    assert served(repository) == {"words": "words.mar"}


def test_a_missing_archive_is_named_and_nothing_written(
    store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    repository = tmp_path / "models"
    repository.mkdir()
    flags = ["--model-store", str(store), "--model-dir", str(repository)]
    assert main([*flags, "--models", "words.mar,nope.mar"]) == 2
    assert "Model not found at: nope.mar" in caplog.text
    assert served(repository) == {}
    assert main(["--model-store", str(tmp_path / "absent"), "--model-dir", str(repository)]) == 2
    assert "absent: no such folder" in caplog.text


def test_pipeline_run_names_a_missing_archive_and_exits_2(store: Path) -> None:
    finished = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", "--model-store", str(store), "--models", "nope.mar"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 2, finished.stderr[-2000:]
    assert "Model not found at: nope.mar" in finished.stderr
    assert "Traceback" not in finished.stderr

"""The word handler's archive (`words.mar`): made by `torch-model-archiver` where it is installed, else by
`zipfile` in the same layout (MAR-INF/MANIFEST.json, the handler file, the extra file), as the tests say."""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

HERE = Path(__file__).parent
HANDLER = HERE / "word_handler.py"
EXTRA = HERE / "word_vocabulary.py"


def archive_with_archiver(archiver: Path | str, store: Path, name: str = "words") -> Path:
    """`torch-model-archiver`'s archive of the word handler, in `store`."""
    store.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            str(archiver),
            "--model-name",
            name,
            "--version",
            "1.0",
            "--handler",
            str(HANDLER),
            "--extra-files",
            str(EXTRA),
            "--export-path",
            str(store),
            "--force",
        ],
        check=True,
        capture_output=True,
    )
    return store / f"{name}.mar"


def archive_with_zipfile(store: Path, name: str = "words") -> Path:
    """The same archive written with `zipfile`: the layout `torch-model-archiver` writes."""
    store.mkdir(parents=True, exist_ok=True)
    manifest = {
        "createdOn": "01/01/2026 00:00:00",
        "runtime": "python",
        "model": {"modelName": name, "handler": HANDLER.name, "modelVersion": "1.0"},
        "archiverVersion": "0.12.0",
    }
    path = store / f"{name}.mar"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as mar:
        mar.write(HANDLER, HANDLER.name)
        mar.write(EXTRA, EXTRA.name)
        mar.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest, indent=2))
    return path


def word_archive(store: Path, name: str = "words") -> tuple[Path, str]:
    """The archive, and what made it ("torch-model-archiver" or "zipfile")."""
    archiver = shutil.which("torch-model-archiver")
    if archiver is not None:
        return archive_with_archiver(archiver, store, name), "torch-model-archiver"
    return archive_with_zipfile(store, name), "zipfile"

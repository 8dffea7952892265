"""The word handler's archive (`words.mar`), or another handler's (the benchmark's): made by
`torch-model-archiver` where it is installed, else by `zipfile` in the same layout (MAR-INF/MANIFEST.json, the
handler file, the extra files), as the tests say."""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).parent
HANDLER = HERE / "word_handler.py"
EXTRA = HERE / "word_vocabulary.py"


def archive_with_archiver(
    archiver: Path | str,
    store: Path,
    name: str = "words",
    handler: Path = HANDLER,
    extras: Sequence[Path] = (EXTRA,),
) -> Path:
    """`torch-model-archiver`'s archive of the word handler (or of `handler` with `extras`), in `store`."""
    store.mkdir(parents=True, exist_ok=True)
    command = [str(archiver), "--model-name", name, "--version", "1.0", "--handler", str(handler)]
    if extras:
        command += ["--extra-files", ",".join(str(extra) for extra in extras)]
    subprocess.run([*command, "--export-path", str(store), "--force"], check=True, capture_output=True)
    return store / f"{name}.mar"


def archive_with_zipfile(
    store: Path, name: str = "words", handler: Path = HANDLER, extras: Sequence[Path] = (EXTRA,)
) -> Path:
    """The same archive written with `zipfile`: the layout `torch-model-archiver` writes."""
    store.mkdir(parents=True, exist_ok=True)
    manifest = {
        "createdOn": "01/01/2026 00:00:00",
        "runtime": "python",
        "model": {"modelName": name, "handler": handler.name, "modelVersion": "1.0"},
        "archiverVersion": "0.12.0",
    }
    path = store / f"{name}.mar"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as mar:
        for file in (handler, *extras):
            mar.write(file, file.name)
        mar.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest, indent=2))
    return path


def word_archive(store: Path, name: str = "words") -> tuple[Path, str]:
    """The archive, and what made it ("torch-model-archiver" or "zipfile")."""
    archiver = shutil.which("torch-model-archiver")
    if archiver is not None:
        return archive_with_archiver(archiver, store, name), "torch-model-archiver"
    return archive_with_zipfile(store, name), "zipfile"

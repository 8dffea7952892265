"""Copy a model repository into another folder: what compose.yaml's one-shot `model-repository` service runs
to write the example repository (built into its image) into the volume every service mounts at /models.

    python copy-repository.py SOURCE TARGET

A file that is new or differs is written through a temporary file in its folder, then renamed, so a service
reading the folder meanwhile (a restart, a `RepositoryModelLoad`) never sees half a model; files alike are
left alone, so running it again (every `docker compose up`) writes nothing. Files that only the target holds
are kept: a model version added to the volume stays until `docker compose down -v`. Standard library only:
the image has no project code.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path


def copy_file(source: Path, target: Path) -> None:
    """Write `source` over `target` atomically (a temporary file in the same folder, then a rename)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".partial-")
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o644)  # the services run as another user than the one writing, in some set-ups
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def copy_repository(source: Path, target: Path) -> list[Path]:
    """Copy every file of `source` that `target` lacks or holds differently; returns those written."""
    written = []
    for path in sorted(source.rglob("*")):
        if path.is_dir():
            continue
        relative = path.relative_to(source)
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        if destination.is_file() and filecmp.cmp(path, destination, shallow=False):
            continue
        copy_file(path, destination)
        written.append(relative)
    return written


def main() -> None:
    """Copy SOURCE into TARGET and say what was written."""
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} SOURCE TARGET")
    source, target = Path(sys.argv[1]), Path(sys.argv[2])
    if not source.is_dir():
        raise SystemExit(f"{source}: no such folder")
    written = copy_repository(source, target)
    models = sorted({relative.parts[0] for relative in written})
    if written:
        print(f"model repository {target}: wrote {len(written)} file(s) of {', '.join(models)}")
    else:
        print(f"model repository {target}: up to date")


if __name__ == "__main__":
    main()

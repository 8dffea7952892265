"""A model repository in Triton's layout, read the same way by every service and by the router.

    <repository>/
      <model>/
        config.pbtxt          # Triton's text format of `inference.ModelConfig` (optional where it can be completed)
        1/model.onnx          # one folder per version, named by a positive integer
        2/model.onnx

`config.pbtxt` is parsed with protobuf's `text_format` into the `inference.ModelConfig` message of `protos/`:
a syntax error or an unknown field refuses the model with the file, the line and the cause. A model's backend
comes from its config (`backend`, or `platform` as Triton names it) or, without either, from the artifact in
its newest version folder (`model.onnx`, `model.pt`, `model.pt2`, `model.plan`, `model.py`); a config with
`platform: "ensemble"` is an ensemble, which only the router runs. Each service serves the entries whose
backend it runs.

Paths never leave the repository: a model is a plain folder name directly inside it, an artifact a plain
file name inside its version folder, and symbolic links that lead outside are refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import RepositoryError, RepositoryNotFound, echo
from pipeline.protocol.model_config import check_response_cache, read_config, select_versions

log = logging.getLogger(__name__)

CONFIG_FILE = "config.pbtxt"

#: Triton's platform names and the backend that runs each.
PLATFORM_BACKENDS: Mapping[str, str] = {
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "pytorch_torch_export": "pytorch",
    "tensorrt_plan": "tensorrt",
    "ensemble": "ensemble",
    # A Python model's config here reports its platform as its metadata does (Triton's config: ""), so the
    # config a client reads loads back.
    "python": "python",
}
#: The backends a repository entry may name (Triton's names), and the platform each reports by default.
BACKEND_PLATFORMS: Mapping[str, str] = {
    "onnxruntime": "onnxruntime_onnx",
    "pytorch": "pytorch_libtorch",
    "tensorrt": "tensorrt_plan",
    "python": "python",
    "ensemble": "ensemble",
}
#: Triton's alternative spellings of backend names.
_BACKEND_ALIASES: Mapping[str, str] = {
    "onnx": "onnxruntime",
    "libtorch": "pytorch",
    "tensorrt_plan": "tensorrt",
}
#: Default artifact file names of each backend, in the order they are looked for.
DEFAULT_FILENAMES: Mapping[str, tuple[str, ...]] = {
    "onnxruntime": ("model.onnx",),
    "pytorch": ("model.pt", "model.pt2"),
    "tensorrt": ("model.plan",),
    "python": ("model.py",),
}
#: The backend an artifact's file name implies, by suffix.
_SUFFIX_BACKENDS: Mapping[str, str] = {
    ".onnx": "onnxruntime",
    ".pt": "pytorch",
    ".pt2": "pytorch",
    ".plan": "tensorrt",
    ".engine": "tensorrt",
    ".py": "python",
}

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
#: The longest model name: the longest folder name most file systems take (NAME_MAX).
MAX_NAME_BYTES = 255


# ---- config.pbtxt ---------------------------------------------------------------------------------------------


# ---- versions -------------------------------------------------------------------------------------------------


# ---- entries --------------------------------------------------------------------------------------------------


def check_model_name(name: str) -> None:
    """Raise `RepositoryNotFound` where no repository can hold a model named `name`: a model is a folder
    directly inside the repository, so its name is a plain one (letters, digits, '.', '_' and '-', not
    starting with '.'; '/' and '..' never), at most `MAX_NAME_BYTES` long. Triton 2.51 answers such a name
    as it answers a model its repository lacks; so do the stages and the router, alike."""
    if len(name.encode()) > MAX_NAME_BYTES:
        why = f"it is longer than a folder name may be ({len(name.encode())} bytes, at most {MAX_NAME_BYTES})"
    elif not _PLAIN_NAME.fullmatch(name):
        why = (
            "it is not a plain name (letters, digits, '.', '_' and '-', not starting with '.'), and a model "
            "is a folder directly inside the repository"
        )
    else:
        return
    raise RepositoryNotFound(f"no model repository can hold a model named '{echo(name)}': {why}")


def _confined(path: Path, root: Path, what: str) -> Path:
    """`path` if it stays inside `root` once links are resolved; `RepositoryError` otherwise."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise RepositoryError(f"{what} {path} leads outside the repository (to {resolved})")
    return path


def backend_name(name: str, source: str) -> str:
    """A backend named in a config, in Triton's canonical spelling; `RepositoryError` for unknown ones."""
    canonical = _BACKEND_ALIASES.get(name, name)
    if canonical not in BACKEND_PLATFORMS:
        raise RepositoryError(
            f"{source}: unknown backend '{name}' (known: {', '.join(b for b in BACKEND_PLATFORMS if b != 'ensemble')})"
        )
    return canonical


@dataclass(frozen=True)
class RepositoryEntry:
    """One model as the repository holds it now."""

    name: str
    #: The model's folder.
    folder: Path
    #: The config as read (an empty config naming the model when there is no `config.pbtxt`), with `name`
    #: set. Backends complete it (auto-complete) when they load a version.
    config: mc.ModelConfig
    #: Whether a `config.pbtxt` exists.
    has_config: bool
    #: "onnxruntime", "pytorch", "tensorrt", "python" or "ensemble".
    backend: str
    #: Version folders (positive integer names), oldest first.
    versions: tuple[str, ...]

    @property
    def source(self) -> str:
        """How messages name the entry: its `config.pbtxt`, or its folder without one."""
        return str(self.folder / CONFIG_FILE) if self.has_config else f"model '{self.name}' ({self.folder})"

    def served_versions(self) -> list[str]:
        """The versions the policy serves; `RepositoryNotFound` when there are none."""
        if not self.versions:
            raise RepositoryNotFound(
                f"model '{self.name}': no version folder in {self.folder} (expected {self.folder}/1/...)"
            )
        return select_versions(self.config.version_policy, self.versions, self.source)

    def version_dir(self, version: str) -> Path:
        """A version's folder; `RepositoryNotFound` when the repository has no such version."""
        if version not in self.versions:
            raise RepositoryNotFound(
                f"model '{self.name}' has no version '{version}' (versions: {', '.join(self.versions) or 'none'})"
            )
        return _confined(self.folder / version, self.folder, f"model '{self.name}' version folder")

    def artifact(self, version: str, candidates: Iterable[str] = ()) -> Path:
        """The file a version is loaded from: `default_model_filename` when the config sets one, else the
        first of `candidates` (default: the backend's default names) that exists."""
        folder = self.version_dir(version)
        if self.config.default_model_filename:
            names: tuple[str, ...] = (self.config.default_model_filename,)
        else:
            names = tuple(candidates) or DEFAULT_FILENAMES.get(self.backend, ())
        for file_name in names:
            if not _PLAIN_NAME.fullmatch(file_name):
                raise RepositoryError(
                    f"{self.source}: default_model_filename {file_name!r} is not a plain file name inside the "
                    "version folder"
                )
            path = folder / file_name
            if path.exists():
                return _confined(path, self.folder, f"model '{self.name}' artifact")
        raise RepositoryError(
            f"model '{self.name}' version {version}: no {' or '.join(names) or 'artifact'} in {folder}"
        )

    def fingerprint(self, version: str) -> str:
        """Changes when the config or any file of the version folder does (name, size, modification time)."""
        digest = hashlib.sha256(self.config.SerializeToString(deterministic=True))
        folder = self.folder / version
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            stat = path.stat()
            digest.update(f"{path.relative_to(folder)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return digest.hexdigest()


class ModelRepository:
    """A repository folder; it need not exist (then it holds no models)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"ModelRepository({str(self.root)!r})"

    def names(self) -> list[str]:
        """Every model folder: a plain-named folder holding a `config.pbtxt` or a version folder."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            if not child.is_dir() or not _PLAIN_NAME.fullmatch(child.name) or child.name.startswith("."):
                continue
            if (child / CONFIG_FILE).is_file() or any(_is_version(c) for c in child.iterdir()):
                found.append(child.name)
        return sorted(found)

    def folder(self, name: str) -> Path:
        """A model's folder: a plain name directly under the repository, never a path that leaves it
        (`check_model_name`)."""
        check_model_name(name)
        return _confined(self.root / name, self.root, f"model '{name}': its folder")

    def read(self, name: str, config: mc.ModelConfig | None = None) -> RepositoryEntry:
        """A model's entry as the disk says now; `RepositoryNotFound` when there is no such model.

        `config` replaces the model's `config.pbtxt` (what `RepositoryModelLoad`'s `config` parameter does).
        """
        folder = self.folder(name)
        if not folder.is_dir():
            raise RepositoryNotFound(f"model '{name}': no folder {folder} in the repository {self.root}")
        config_path = folder / CONFIG_FILE
        if config is not None:
            config = _copy(config)
            has_config, source = True, f"model '{name}': the load's config"
        else:
            has_config = config_path.is_file()
            config = read_config(config_path) if has_config else mc.ModelConfig()
            source = str(config_path) if has_config else f"model '{name}' ({folder})"
        if config.name and config.name != name:
            raise RepositoryError(f"{source}: name '{config.name}' differs from the folder's name '{name}'")
        config.name = name
        check_response_cache(config, source)
        versions = tuple(sorted((c.name for c in folder.iterdir() if _is_version(c)), key=int))
        backend = self._backend(config, folder, versions, source)
        return RepositoryEntry(name, folder, config, has_config, backend, versions)

    def entries(self, backends: Collection[str]) -> dict[str, RepositoryEntry | RepositoryError]:
        """Every model whose backend is one of `backends`, by name; a model that cannot be read maps to its
        error (the caller decides whether it concerns it: an unreadable entry may be anybody's)."""
        found: dict[str, RepositoryEntry | RepositoryError] = {}
        for name in self.names():
            try:
                entry = self.read(name)
            except RepositoryError as exc:
                found[name] = exc
                continue
            if entry.backend in backends:
                found[name] = entry
        return found

    @staticmethod
    def _backend(config: mc.ModelConfig, folder: Path, versions: tuple[str, ...], source: str) -> str:
        by_backend = backend_name(config.backend, source) if config.backend else ""
        by_platform = ""
        if config.platform:
            by_platform = PLATFORM_BACKENDS.get(config.platform, "")
            if not by_platform:
                raise RepositoryError(
                    f"{source}: unknown platform '{config.platform}' (known: {', '.join(PLATFORM_BACKENDS)})"
                )
        if by_backend and by_platform and by_backend != by_platform:
            raise RepositoryError(
                f"{source}: platform '{config.platform}' and backend '{config.backend}' disagree"
            )
        if by_backend or by_platform:
            return by_backend or by_platform
        # Neither named: the artifact of the newest version says.
        for version in reversed(versions):
            names = [config.default_model_filename] if config.default_model_filename else None
            for child in sorted((folder / version).iterdir()) if names is None else []:
                if child.name.startswith("model.") and child.suffix in _SUFFIX_BACKENDS:
                    names = [child.name]
                    break
            for file_name in names or ():
                backend = _SUFFIX_BACKENDS.get(Path(file_name).suffix)
                if backend:
                    return backend
        raise RepositoryError(
            f"{source}: names no platform or backend, and no version folder holds a model file it could be "
            f"told from ({', '.join(n for names in DEFAULT_FILENAMES.values() for n in names)})"
        )


def _copy(config: mc.ModelConfig) -> mc.ModelConfig:
    copy = mc.ModelConfig()
    copy.CopyFrom(config)
    return copy


def _is_version(path: Path) -> bool:
    return path.is_dir() and path.name.isdigit() and int(path.name) > 0

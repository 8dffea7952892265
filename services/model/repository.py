"""The model repository: Triton's layout, one `config.yaml` per model, version policies and instance placement.

    models/
      digits_cnn/
        config.yaml            # architecture, backend, max_batch_size, precision, instance_group, version_policy
        1/model.pt             # one folder per version, named by a positive integer
        2/model.pt
      refcnn_cnn/config.yaml   # optional: a built-in model's settings (its weights need no files)

`config.yaml` (every key optional except `architecture` for a model the service does not know):

    architecture: digits_cnn          # digits_cnn | refcnn | minilm (services.model.networks)
    backend: auto                     # auto | torch | tensorrt; default: the service's --backend
    max_batch_size: 256               # at most the network's
    preferred_batch_size: 32          # TensorRT profile's opt batch
    precision: fp32                   # fp32 | fp16
    instance_group: [{count: 2, kind: gpu, gpus: [0]}]   # kind auto | gpu | cpu
    version_policy: {latest: {num_versions: 1}}          # or {all: {}} or {specific: {versions: [1, 3]}}
    torch: {mode: eager, compile: false, cuda_graphs: false}

Built-in models (`refcnn_cnn`, `minilm_encoder`) are served whether or not the repository has a folder for
them: their weights come from a seed and from an installed package, so they have one implicit version, 1. A
folder with their name gives them a config (and versions, if it has version folders; a MiniLM version folder
may hold its own `config.json` and `model.safetensors`). `digits_cnn` without a `config.yaml` (a repository
trained before configs existed) gets its built-in default config.

Instances (Triton's `instance_group`): `kind: gpu` with `gpus` places `count` instances on each GPU named;
without `gpus`, `count` instances are spread round-robin over the visible GPUs. `kind: cpu` places `count` on
the CPU. `kind: auto` (and no `instance_group`) means the service's `--device`: a GPU when one is visible
(round-robin), else the CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.errors import PipelineError
from services.model.backends import BACKEND_KINDS, PRECISIONS, TorchOptions
from services.model.networks import Network, network

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
_MODEL_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


class RepositoryError(PipelineError):
    """The repository cannot give what was asked: a bad config, a missing version, an unreadable file."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class InstanceGroup(BaseModel):
    """Triton's `instance_group` entry."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(1, ge=1)
    kind: Literal["auto", "gpu", "cpu"] = "auto"
    gpus: list[int] = Field(default_factory=list)

    @model_validator(mode="after")
    def _gpus_need_gpu_kind(self) -> InstanceGroup:
        if self.gpus and self.kind == "cpu":
            raise ValueError("gpus are named but kind is cpu")
        if any(g < 0 for g in self.gpus):
            raise ValueError(f"gpus must be >= 0, got {self.gpus}")
        return self


class Latest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_versions: int = Field(1, ge=1)


class Specific(BaseModel):
    model_config = ConfigDict(extra="forbid")
    versions: list[int] = Field(min_length=1)


class VersionPolicy(BaseModel):
    """Triton's `version_policy`: exactly one of `latest`, `all`, `specific`."""

    model_config = ConfigDict(extra="forbid")

    latest: Latest | None = None
    all: dict[str, Any] | None = None
    specific: Specific | None = None

    @model_validator(mode="after")
    def _one_choice(self) -> VersionPolicy:
        chosen = [k for k in ("latest", "all", "specific") if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ValueError(f"give one of latest, all, specific; got {', '.join(chosen)}")
        if not chosen:
            self.latest = Latest()
        return self

    def select(self, available: list[str]) -> list[str]:
        """The versions to serve out of `available` (sorted numerically); `RepositoryError`-worthy
        problems raise `ValueError`."""
        ordered = sorted(available, key=int)
        if self.all is not None:
            return ordered
        if self.specific is not None:
            wanted = [str(v) for v in self.specific.versions]
            missing = [v for v in wanted if v not in ordered]
            if missing:
                raise ValueError(
                    f"version_policy names version(s) {', '.join(missing)}, which have no folder "
                    f"(found: {', '.join(ordered) or 'none'})"
                )
            return sorted(set(wanted), key=int)
        assert self.latest is not None
        return ordered[-self.latest.num_versions :]

    def describe(self) -> dict[str, Any]:
        """The policy as a `config.yaml` value."""
        return self.model_dump(exclude_none=True)


class TorchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["eager", "script", "export"] = "eager"
    compile: bool = False
    cuda_graphs: bool = False

    def options(self) -> TorchOptions:
        return TorchOptions(mode=self.mode, compile=self.compile, cuda_graphs=self.cuda_graphs)


class ModelConfigFile(BaseModel):
    """A model's `config.yaml`."""

    model_config = ConfigDict(extra="forbid")

    architecture: str
    backend: Literal["auto", "torch", "tensorrt"] | None = None
    max_batch_size: int | None = Field(None, ge=1)
    preferred_batch_size: int | None = Field(None, ge=1)
    precision: Literal["fp32", "fp16"] = "fp32"
    instance_group: list[InstanceGroup] = Field(default_factory=list)
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy)
    torch: TorchSettings = Field(default_factory=TorchSettings)


assert set(BACKEND_KINDS) == {"auto", "torch", "tensorrt"} and set(PRECISIONS) == {"fp32", "fp16"}

#: Models the service knows without a config file, with their defaults.
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "digits_cnn": {"architecture": "digits_cnn"},
    "refcnn_cnn": {"architecture": "refcnn"},
    "minilm_encoder": {"architecture": "minilm"},
}
#: Built-ins whose weights need no files: served with an implicit version 1 when they have no version folders.
BUILTIN_WEIGHTS = frozenset({"refcnn_cnn", "minilm_encoder"})


@dataclass(frozen=True)
class ModelEntry:
    """One model as the repository holds it now."""

    name: str
    #: Its folder (None: a built-in model with no folder).
    folder: Path | None
    config: ModelConfigFile
    network: Network
    #: Version folders found (numeric names), sorted; ["1"] for a built-in model without any.
    versions: tuple[str, ...]
    #: Whether the versions are implicit (built-in weights, no folders).
    implicit: bool = False

    @property
    def max_batch_size(self) -> int:
        return self.config.max_batch_size or self.network.max_batch_size

    def served_versions(self) -> list[str]:
        """The versions the policy names, each checked to be loadable from disk; `RepositoryError` if none."""
        if not self.versions:
            raise RepositoryError(
                f"model '{self.name}': no version folders in {self.folder} (expected {self.folder}/1/...)"
            )
        try:
            chosen = self.config.version_policy.select(list(self.versions))
        except ValueError as exc:
            raise RepositoryError(f"model '{self.name}': {exc}") from None
        for version in chosen:
            self.version_dir(version)
        return chosen

    def version_dir(self, version: str) -> Path | None:
        """A version's folder, its weights file checked to exist and be readable (None: built-in weights)."""
        if version not in self.versions:
            raise RepositoryError(
                f"model '{self.name}' has no version '{version}' (versions: {', '.join(self.versions)})"
            )
        if self.implicit:
            return None
        assert self.folder is not None
        folder = self.folder / version
        if self.network.weights_file:
            weights = folder / self.network.weights_file
            if not weights.is_file():
                raise RepositoryError(
                    f"model '{self.name}' version {version}: weights file {weights} is missing"
                    + (
                        "; run `make model` to train them"
                        if self.network.architecture == "digits_cnn"
                        else ""
                    )
                )
            if not os.access(weights, os.R_OK):
                raise RepositoryError(f"model '{self.name}' version {version}: cannot read {weights}")
        return folder

    def fingerprint(self, version: str) -> str:
        """Changes when the config or any file of the version folder does (name, size, mtime)."""
        digest = hashlib.sha256(self.config.model_dump_json().encode())
        if not self.implicit and self.folder is not None:
            folder = self.folder / version
            for path in sorted(p for p in folder.rglob("*") if p.is_file()):
                stat = path.stat()
                digest.update(f"{path.relative_to(folder)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return digest.hexdigest()


def _format_validation(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in exc.errors()
    )


def parse_config(
    name: str, text: str | None, *, source: str, override: Mapping[str, Any] | None = None
) -> ModelConfigFile:
    """A model's config from YAML text (None: the built-in default) plus `override` keys; `RepositoryError`
    naming `source` and the bad key."""
    data: dict[str, Any] = dict(BUILTIN_CONFIGS.get(name, {}))
    if text is not None:
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise RepositoryError(f"model '{name}': {source} is not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise RepositoryError(f"model '{name}': {source} must be a mapping, got {type(loaded).__name__}")
        data.update(loaded)
    data.update(override or {})
    if "architecture" not in data:
        raise RepositoryError(
            f"model '{name}': {source} must name an architecture (one of {', '.join(_archs())})"
        )
    try:
        config = ModelConfigFile.model_validate(data)
        net = network(config.architecture)
    except ValidationError as exc:
        raise RepositoryError(f"model '{name}': {source}: {_format_validation(exc)}") from None
    except ValueError as exc:
        raise RepositoryError(f"model '{name}': {source}: {exc}") from None
    if config.max_batch_size and config.max_batch_size > net.max_batch_size:
        raise RepositoryError(
            f"model '{name}': {source}: max_batch_size {config.max_batch_size} is over {config.architecture}'s "
            f"{net.max_batch_size}"
        )
    if config.preferred_batch_size and config.preferred_batch_size > (
        config.max_batch_size or net.max_batch_size
    ):
        raise RepositoryError(f"model '{name}': {source}: preferred_batch_size is over max_batch_size")
    return config


def _archs() -> list[str]:
    from services.model.networks import NETWORKS

    return list(NETWORKS)


class ModelRepository:
    """A repository folder (which need not exist: then only the built-in models are in it)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def names(self) -> list[str]:
        """Every model: folders with a `config.yaml` or a built-in name, and the built-ins (digits_cnn too:
        the service exists to serve it, so a repository without it is an error that says to train it)."""
        found = set(BUILTIN_CONFIGS)
        if self.root.is_dir():
            for child in self.root.iterdir():
                if (
                    child.is_dir()
                    and not child.name.startswith(".")
                    and ((child / CONFIG_FILE).is_file() or child.name in BUILTIN_CONFIGS)
                ):
                    found.add(child.name)
        return sorted(found)

    def _folder(self, name: str) -> Path:
        """The model's folder: a plain name directly under the repository, never a path that leaves it."""
        if not _MODEL_NAME.fullmatch(name):
            raise RepositoryError(
                f"model name {name!r} is not a plain name (letters, digits, '.', '_' and '-', not starting "
                "with '.'): a model is a folder directly inside the repository"
            )
        folder = self.root / name
        if folder.resolve().parent != self.root.resolve():  # a symlink out of the repository
            raise RepositoryError(f"model '{name}': its folder leads outside the repository")
        return folder

    def read(self, name: str, override: Mapping[str, Any] | None = None) -> ModelEntry:
        """A model's entry as the disk says now (`override`: config keys that win over the file)."""
        folder = self._folder(name)
        if not folder.is_dir():
            if name in BUILTIN_WEIGHTS:
                config = parse_config(name, None, source="built-in config", override=override)
                return ModelEntry(name, None, config, network(config.architecture), ("1",), implicit=True)
            if name in BUILTIN_CONFIGS:
                raise RepositoryError(
                    f"model '{name}': no folder {folder}; run `make model` (python -m services.model.train) "
                    "to train it"
                )
            raise RepositoryError(f"model '{name}': no folder {folder} in the repository")
        config_path = folder / CONFIG_FILE
        text: str | None = None
        if config_path.is_file():
            try:
                text = config_path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise RepositoryError(f"model '{name}': cannot read {config_path}: {exc}") from None
        elif name not in BUILTIN_CONFIGS:
            raise RepositoryError(f"model '{name}': {config_path} is missing")
        config = parse_config(name, text, source=str(config_path), override=override)
        versions = tuple(
            sorted(
                (c.name for c in folder.iterdir() if c.is_dir() and c.name.isdigit() and int(c.name) > 0),
                key=int,
            )
        )
        if not versions and name in BUILTIN_WEIGHTS:
            return ModelEntry(name, folder, config, network(config.architecture), ("1",), implicit=True)
        return ModelEntry(name, folder, config, network(config.architecture), versions)


def place_instances(
    groups: list[InstanceGroup], *, gpu_count: int, default_device: str = "auto"
) -> list[str]:
    """The device of every instance, in order ("cpu", "cuda:N"); `RepositoryError` for impossible placements.

    `default_device` ("auto", "cpu", "cuda", "cuda:N": the service's `--device`) decides `kind: auto` and the
    placement when there is no `instance_group`.
    """
    groups = groups or [InstanceGroup()]
    devices: list[str] = []
    turn = 0
    for group in groups:
        kind = group.kind
        if kind == "auto":
            if default_device == "cpu":
                kind = "cpu"
            elif default_device.startswith("cuda:") and not group.gpus:
                devices += [default_device] * group.count
                continue
            else:
                kind = "gpu" if gpu_count or default_device == "cuda" else "cpu"
        if kind == "cpu":
            devices += ["cpu"] * group.count
            continue
        if gpu_count == 0:
            raise RepositoryError("instance_group asks for GPU instances, but no CUDA GPU is visible")
        if group.gpus:
            unknown = [g for g in group.gpus if g >= gpu_count]
            if unknown:
                raise RepositoryError(
                    f"instance_group names GPU(s) {unknown}, but only {gpu_count} are visible (0..{gpu_count - 1})"
                )
            for gpu in group.gpus:
                devices += [f"cuda:{gpu}"] * group.count
        else:
            for _ in range(group.count):
                devices.append(f"cuda:{turn % gpu_count}")
                turn += 1
    return devices


def write_config(folder: str | os.PathLike[str], config: Mapping[str, Any]) -> Path:
    """Write a model's `config.yaml` (validated first), atomically."""
    folder = Path(folder)
    parse_config(folder.name, json.dumps(dict(config)), source="the config to write")
    path = folder / CONFIG_FILE
    partial = path.with_suffix(".yaml.partial")
    partial.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    os.replace(partial, path)
    return path


def check_repository(repository: ModelRepository, backend: str, device: str) -> None:
    """Fail before serving, with the repository's own words, when a model cannot load: a bad config, missing
    versions or weights, an impossible placement, a backend that cannot run here."""
    import torch

    from services.model.backends import resolve_backend

    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for name in repository.names():
        entry = repository.read(name)
        entry.served_versions()
        for placed in place_instances(
            entry.config.instance_group, gpu_count=gpu_count, default_device=device
        ):
            resolve_backend(entry.config.backend or backend, placed)

"""TorchServe's model archives (`.mar`) as models of a repository, and the messages between the router's
TorchServe API and the model that runs a handler.

A `.mar` is a zip: `MAR-INF/MANIFEST.json` (the model's name, version, handler, serialized file, model file),
the handler's file and the extra files. A model store is a folder of them. Each archive served becomes a
repository folder of its own, which every service reads as any other Python model:

    <repository>/<model>/config.pbtxt   # backend "python", the archive's path and TorchServe's settings as
                                        # parameters, batch_size as max_batch_size, max_batch_delay as the
                                        # dynamic batcher's queue delay, the workers as instances
    <repository>/<model>/1/model.py     # runs the handler (`pipeline.stage.torchserve.handler_model`)

The folder is the registry: `pipeline run --model-store` writes the folders of the archives it loads at
start-up, the router's management API writes (register), rewrites (scale) and removes (unregister) them.

With `pipeline run --split-handlers`, an archive whose handler is a `BaseHandler` subclass runs as three
models instead, one per method of the handler (`pipeline.stage.torchserve.handler_parts`), joined by an
ensemble under the archive's name, whose config keeps the archive's parameters:

    <repository>/<model>/config.pbtxt              # platform "ensemble": preprocess -> inference -> postprocess
    <repository>/<model>_preprocess/...           # on the preprocess service (it has no GPU parameter)
    <repository>/<model>_inference/...            # on the model service
    <repository>/<model>_postprocess/...          # on the postprocess service

One TorchServe request is one row of the model's batch: a BYTES element `TS_REQUEST` carrying the request's
headers and its parameters (the body, or the form's fields) and a BYTES element `TS_RESPONSE` carrying the
handler's answer for it (status, reason phrase, content type, headers, body). Each is a small JSON header
followed by the raw bytes it describes (`pack`, `unpack`), so bodies travel without being encoded again.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import ConfigError, RepositoryError

#: The model's one input and one output: a TorchServe request and its answer, per row.
REQUEST_TENSOR = "TS_REQUEST"
RESPONSE_TENSOR = "TS_RESPONSE"
#: Between the three models of a split handler: each request's data and state (`handler_parts`).
DATA_TENSOR = "TS_DATA"
STATE_TENSOR = "TS_STATE"
#: The config parameter that marks a repository model as a TorchServe archive, and names its file.
ARCHIVE_PARAMETER = "torchserve_archive"
#: The parameter naming the handler method one model of a split handler runs, and those methods in order.
PART_PARAMETER = "torchserve_part"
PARTS = ("preprocess", "inference", "postprocess")
#: TorchServe's settings of the model, kept as config parameters (for describe and for the handler).
_PARAMETERS = ("url", "model_version", "max_workers", "response_timeout", "handler", "runtime")
#: The `model.py` of every archive's folder.
MODEL_FILE = (
    '"""A TorchServe model archive: its handler runs here (pipeline.stage.torchserve.handler_model)."""\n\n'
    "from pipeline.stage.torchserve.handler_model import TritonPythonModel\n\n"
    '__all__ = ["TritonPythonModel"]\n'
)
#: TorchServe's defaults for a model registered without them.
DEFAULT_BATCH_SIZE = 1
DEFAULT_MAX_BATCH_DELAY_MS = 100
DEFAULT_RESPONSE_TIMEOUT_S = 120
MANIFEST = "MAR-INF/MANIFEST.json"
#: The archive's Python packages, which TorchServe installs only with `install_py_dep_per_model=true`.
REQUIREMENTS = "requirements.txt"
#: TorchServe's built-in handlers (a manifest's `handler` without a file), and the packages each needs.
BUILT_IN_HANDLERS = {
    "image_classifier": ("torchvision", "PIL"),
    "image_segmenter": ("torchvision", "PIL"),
    "object_detector": ("torchvision", "PIL"),
    "text_classifier": ("torchtext",),
}


@dataclass(frozen=True, slots=True)
class ArchiveModel:
    """A model of a TorchServe archive, with the settings TorchServe gives a model."""

    name: str
    #: The `.mar` file (absolute), and the `url` it was registered with (a file name of the model store).
    archive: Path
    url: str
    #: The manifest's `modelVersion` (TorchServe's versions are strings: "1.0").
    version: str
    handler: str = ""
    runtime: str = "python"
    batch_size: int = DEFAULT_BATCH_SIZE
    max_batch_delay_ms: int = DEFAULT_MAX_BATCH_DELAY_MS
    min_workers: int = 1
    max_workers: int = 1
    response_timeout_s: int = DEFAULT_RESPONSE_TIMEOUT_S
    #: The handler's three methods run as three models (`--split-handlers`), else as one.
    split: bool = False
    #: The folder the archive's requirements.txt was installed into (`install_py_dep_per_model`), if any.
    dependencies: str = ""

    def part_names(self) -> list[str]:
        """The models of a split handler's methods, in order (none for one that is not split)."""
        return [f"{self.name}_{part}" for part in PARTS] if self.split else []

    def scaled(self, min_workers: int, max_workers: int) -> ArchiveModel:
        return replace(self, min_workers=min_workers, max_workers=max_workers)


def read_manifest(archive: Path) -> dict[str, Any]:
    """The archive's `MAR-INF/MANIFEST.json`; `RepositoryError` naming the file where it is not one."""
    try:
        with zipfile.ZipFile(archive) as mar:
            manifest = json.loads(mar.read(MANIFEST))
    except (OSError, KeyError, zipfile.BadZipFile, ValueError) as exc:
        raise RepositoryError(f"{archive}: not a TorchServe model archive ({MANIFEST}): {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("model"), dict):
        raise RepositoryError(f"{archive}: {MANIFEST} has no 'model' object")
    return manifest


def archive_model(store: Path, url: str, name: str | None = None, **settings: Any) -> ArchiveModel:
    """The model of the archive `url` (a file name of the model store), named `name` or as its manifest
    says; `RepositoryError` where the store has no such archive."""
    if "/" in url or "\\" in url or url in ("", ".", ".."):
        raise RepositoryError(f"Model not found at: {url}")
    archive = (store / url).resolve()
    if not archive.is_file():
        raise RepositoryError(f"Model not found at: {url}")
    model = read_manifest(archive)["model"]
    return ArchiveModel(
        name=name or str(model.get("modelName") or archive.stem),
        archive=archive,
        url=url,
        version=str(model.get("modelVersion") or "1.0"),
        handler=str(model.get("handler") or ""),
        runtime="python",
        **settings,
    )


def refusal(model: ArchiveModel, install_dependencies: bool) -> str | None:
    """Why the archive cannot be served here (None where it can): a TorchServe built-in handler named
    instead of a handler file (with the packages it would need that are missing), or a requirements.txt
    where TorchServe would not install it (`install_dependencies`: config.properties'
    `install_py_dep_per_model`)."""
    with zipfile.ZipFile(model.archive) as mar:
        files = set(mar.namelist())
    module = model.handler.partition(":")[0].removesuffix(".py")
    if module in BUILT_IN_HANDLERS and f"{module}.py" not in files:
        missing = [
            package for package in BUILT_IN_HANDLERS[module] if importlib.util.find_spec(package) is None
        ]
        why = f"needs {', '.join(missing)}, which is not installed" if missing else "is not provided"
        return (
            f"{model.url}: handler '{model.handler}' is TorchServe's built-in {module.replace('_', ' ')}, which "
            f"{why} here: package a handler file with the archive (torch-model-archiver --handler "
            "my_handler.py)"
        )
    if REQUIREMENTS in files and not install_dependencies:
        return (
            f"{model.url}: the archive has a {REQUIREMENTS}, which TorchServe installs only with "
            "install_py_dep_per_model=true: here it is installed for the archives loaded at start-up (--models) "
            "where the --ts-config file sets it; or install the packages into the services' environment"
        )
    return None


# ---- the repository folder --------------------------------------------------------------------------------


def model_config(model: ArchiveModel) -> mc.ModelConfig:
    """The `config.pbtxt` of an archive's folder: its model, or the ensemble of its split handler."""
    if model.split:
        config = mc.ModelConfig(name=model.name, platform="ensemble", max_batch_size=max(1, model.batch_size))
        tensors = {REQUEST_TENSOR: REQUEST_TENSOR}
        for part, name in zip(PARTS, model.part_names(), strict=True):
            step = config.ensemble_scheduling.step.add(model_name=name, model_version=-1)
            step.input_map.update(tensors)
            outputs = (RESPONSE_TENSOR,) if part == PARTS[-1] else (DATA_TENSOR, STATE_TENSOR)
            tensors = {tensor: f"{part}_{tensor.lower()}" for tensor in outputs}
            step.output_map.update({RESPONSE_TENSOR: RESPONSE_TENSOR} if part == PARTS[-1] else tensors)
        config.input.add(name=REQUEST_TENSOR, data_type=mc.TYPE_STRING, dims=[1])
        config.output.add(name=RESPONSE_TENSOR, data_type=mc.TYPE_STRING, dims=[1])
    else:
        config = _handler_config(model, model.name, (REQUEST_TENSOR,), (RESPONSE_TENSOR,))
    values = {
        ARCHIVE_PARAMETER: str(model.archive),
        "url": model.url,
        "model_version": model.version,
        "max_workers": str(model.max_workers),
        "min_workers": str(model.min_workers),
        "batch_size": str(model.batch_size),
        "max_batch_delay": str(model.max_batch_delay_ms),
        "response_timeout": str(model.response_timeout_s),
        "handler": model.handler,
        "runtime": model.runtime,
        "split": "true" if model.split else "false",
        "dependencies": model.dependencies,
    }
    for key, value in values.items():
        config.parameters[f"torchserve_{key}" if key != ARCHIVE_PARAMETER else key].string_value = value
    return config


def part_config(model: ArchiveModel, part: str) -> mc.ModelConfig:
    """The `config.pbtxt` of the model that runs one method of a split handler. The preprocess model
    batches as TorchServe does (up to batch_size requests, waiting for max_batch_delay even when idle); the
    next ones take at once what waits for them when an instance is free."""
    inputs = (REQUEST_TENSOR,) if part == PARTS[0] else (DATA_TENSOR, STATE_TENSOR)
    outputs = (RESPONSE_TENSOR,) if part == PARTS[-1] else (DATA_TENSOR, STATE_TENSOR)
    config = _handler_config(model, f"{model.name}_{part}", inputs, outputs, idle_dispatch=part != PARTS[0])
    config.parameters[ARCHIVE_PARAMETER].string_value = str(model.archive)
    config.parameters[PART_PARAMETER].string_value = part
    config.parameters["torchserve_model_name"].string_value = model.name
    config.parameters["torchserve_dependencies"].string_value = model.dependencies
    return config


def _handler_config(
    model: ArchiveModel,
    name: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    *,
    idle_dispatch: bool = False,
) -> mc.ModelConfig:
    """A Python model that runs the handler (or one of its methods) on batches of BYTES elements."""
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=max(1, model.batch_size))
    for tensor in inputs:
        config.input.add(name=tensor, data_type=mc.TYPE_STRING, dims=[1])
    for tensor in outputs:
        config.output.add(name=tensor, data_type=mc.TYPE_STRING, dims=[1])
    if model.batch_size > 1:
        config.dynamic_batching.max_queue_delay_microseconds = model.max_batch_delay_ms * 1000
        if not idle_dispatch:
            # TorchServe's batching: a batch waits for batch_size requests or max_batch_delay, even when the
            # worker is idle (the router's default would send a lone request at once).
            config.parameters["pipeline.idle_dispatch"].string_value = "false"
    config.instance_group.add(count=max(1, model.min_workers), kind=mc.ModelInstanceGroup.KIND_CPU)
    return config


def write_model(repository: Path, model: ArchiveModel) -> None:
    """Write (or rewrite) the archive's folder in the repository, and its methods' folders where its handler
    is split (those of the other form removed)."""
    earlier = read_model(repository, model.name)
    if earlier is not None and earlier.split != model.split:
        remove_model(repository, model.name)
    folder = repository / model.name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    if model.split:
        for part in PARTS:
            _write_folder(repository / f"{model.name}_{part}", part_config(model, part))
    else:
        (folder / "1" / "model.py").write_text(MODEL_FILE)
    _write_config(folder, model_config(model))


def _write_folder(folder: Path, config: mc.ModelConfig) -> None:
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.py").write_text(MODEL_FILE)
    _write_config(folder, config)


def _write_config(folder: Path, config: mc.ModelConfig) -> None:
    # Written beside, then renamed: a service reading the folder meanwhile sees one config or the other.
    staged = folder / ".config.pbtxt.new"
    staged.write_text(text_format.MessageToString(config))
    staged.replace(folder / "config.pbtxt")


def remove_model(repository: Path, name: str) -> None:
    """Remove an archive's folder (only one this module wrote: it names an archive), and its methods'."""
    model = read_model(repository, name)
    if model is not None:
        for folder in (*model.part_names(), name):
            shutil.rmtree(repository / folder, ignore_errors=True)


def read_model(repository: Path, name: str) -> ArchiveModel | None:
    """The archive model of the repository's folder `name`; None where there is no such folder, or it is not
    an archive's."""
    if not name or "/" in name or name.startswith("."):
        return None
    try:
        text = (repository / name / "config.pbtxt").read_text()
        config = text_format.Parse(text, mc.ModelConfig())
    except (OSError, text_format.ParseError, UnicodeDecodeError):
        return None
    return model_of_config(config)


def model_of_config(config: mc.ModelConfig) -> ArchiveModel | None:
    """The archive model a config describes (`model_config`'s inverse); None for any other model's."""
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    if ARCHIVE_PARAMETER not in parameters or PART_PARAMETER in parameters:
        return None

    def number(key: str, default: int) -> int:
        text = parameters.get(f"torchserve_{key}", "")
        return int(text) if text.isdigit() else default

    return ArchiveModel(
        name=config.name,
        archive=Path(parameters[ARCHIVE_PARAMETER]),
        url=parameters.get("torchserve_url", ""),
        version=parameters.get("torchserve_model_version", "1.0"),
        handler=parameters.get("torchserve_handler", ""),
        runtime=parameters.get("torchserve_runtime", "python"),
        batch_size=number("batch_size", max(1, config.max_batch_size)),
        max_batch_delay_ms=number("max_batch_delay", DEFAULT_MAX_BATCH_DELAY_MS),
        min_workers=number("min_workers", 1),
        max_workers=number("max_workers", 1),
        response_timeout_s=number("response_timeout", DEFAULT_RESPONSE_TIMEOUT_S),
        split=parameters.get("torchserve_split") == "true",
        dependencies=parameters.get("torchserve_dependencies", ""),
    )


def archive_models(repository: Path) -> Iterator[ArchiveModel]:
    """Every archive model of the repository, by name."""
    if not repository.is_dir():
        return
    for folder in sorted(repository.iterdir()):
        model = read_model(repository, folder.name)
        if model is not None:
            yield model


# ---- a model store at start-up ----------------------------------------------------------------------------


def read_properties(path: Path) -> dict[str, str]:
    """TorchServe's `config.properties` (Java properties: `key=value` lines, `#` comments)."""
    properties: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        key, _, value = line.partition("=")
        properties[key.strip()] = value.strip()
    return properties


def startup_models(
    store: Path, models: str, properties: Mapping[str, str] | None = None, split: str = ""
) -> list[ArchiveModel]:
    """The archives `--models` names (`all`, or `name=file.mar` / `file.mar` items, comma-separated), with
    the settings `config.properties` gives them (its `models` JSON, `default_workers_per_model`), their
    handlers split where `split` names them (`all`, or model names, comma-separated)."""
    properties = properties or {}
    items: list[tuple[str | None, str]] = []
    if models.strip() == "all":
        items = [(None, path.name) for path in sorted(store.glob("*.mar"))]
    else:
        for item in filter(None, (part.strip() for part in models.split(","))):
            name, _, url = item.rpartition("=")
            items.append((name or None, url))
    try:
        per_model = json.loads(properties.get("models", "{}") or "{}")
    except ValueError as exc:
        raise ConfigError(f"config.properties: 'models' is not JSON: {exc}") from None
    workers = int(properties.get("default_workers_per_model", "1") or 1)
    install = installs_dependencies(properties)
    found = []
    for given, url in items:
        model = archive_model(store, url, given, min_workers=workers, max_workers=workers)
        if (reason := refusal(model, install)) is not None:
            raise ConfigError(reason)
        found.append(_configured(model, per_model.get(model.name, {})))
    names = {name.strip() for name in split.split(",") if name.strip()}
    if unknown := names - {"all"} - {model.name for model in found}:
        raise ConfigError(
            f"--split-handlers names {', '.join(sorted(unknown))}, which --models does not load "
            f"(loaded: {', '.join(model.name for model in found) or 'none'})"
        )
    return [replace(model, split="all" in names or model.name in names) for model in found]


def installs_dependencies(properties: Mapping[str, str]) -> bool:
    """Whether config.properties has TorchServe install each archive's requirements.txt."""
    return properties.get("install_py_dep_per_model", "false").strip().lower() == "true"


def has_requirements(model: ArchiveModel) -> bool:
    with zipfile.ZipFile(model.archive) as mar:
        return REQUIREMENTS in mar.namelist()


def _configured(model: ArchiveModel, versions: Mapping[str, Any]) -> ArchiveModel:
    """The model with its `config.properties` settings (`models={"name": {"1.0": {...}}}`)."""
    settings: Any = (versions.get(model.version) or next(iter(versions.values()), {})) if versions else {}
    if not isinstance(settings, dict):
        return model
    minimum = int(settings.get("minWorkers", model.min_workers))
    return replace(
        model,
        batch_size=int(settings.get("batchSize", model.batch_size)),
        max_batch_delay_ms=int(settings.get("maxBatchDelay", model.max_batch_delay_ms)),
        min_workers=minimum,
        max_workers=max(minimum, int(settings.get("maxWorkers", model.max_workers))),
        response_timeout_s=int(settings.get("responseTimeout", model.response_timeout_s)),
    )


# ---- one request, one answer -------------------------------------------------------------------------------

_LENGTH = struct.Struct("<I")


def pack(meta: Mapping[str, Any], parts: Sequence[bytes] = ()) -> bytes:
    """A JSON header (with each part's length) followed by the parts' bytes."""
    header = json.dumps({**meta, "lengths": [len(part) for part in parts]}, separators=(",", ":")).encode()
    return b"".join((_LENGTH.pack(len(header)), header, *parts))


def unpack(blob: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """`pack`'s header and parts; `ValueError` where the bytes are not what `pack` makes."""
    if len(blob) < _LENGTH.size:
        raise ValueError("a TorchServe message shorter than its header")
    (size,) = _LENGTH.unpack_from(blob)
    end = _LENGTH.size + size
    meta = json.loads(blob[_LENGTH.size : end])
    parts = []
    for length in meta.pop("lengths"):
        parts.append(blob[end : end + length])
        end += length
    if end != len(blob):
        raise ValueError("a TorchServe message whose parts do not add up to its length")
    return meta, parts

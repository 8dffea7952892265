"""The python backend: stages written in Python, served from a model repository.

    <repository>/<model>/config.pbtxt      # optional for a Stage subclass, required for a TritonPythonModel
    <repository>/<model>/1/model.py

A `model.py` defines either

- exactly one subclass of `pipeline.stage.api.Stage` (defined in that file; subclasses it imports don't count).
  The model is named after its folder. The class declares its tensors, `max_batch_size` and `inline`; a
  `config.pbtxt` may declare them too, and where it declares tensors it wins, as Triton users expect: the
  class's declarations, if it has any, must then agree with it (same names and datatypes; a dimension the
  class leaves -1 the config may fix). A `max_batch_size` of 0 in the config (or none) keeps the class's.
  The config's `parameters` reach the stage as `Stage.parameters` (strings), set before `load()`.
  `instance_group` `count` gives that many Stage objects, each loaded and run on a thread of its own.
- or a `TritonPythonModel`, as written for Triton's Python backend, unmodified: `initialize(args)` gets
  Triton's args (`model_config` as JSON in Triton's field names, `model_instance_kind`,
  `model_instance_name`, `model_instance_device_id`, `model_repository`, `model_version`, `model_name`),
  `execute(requests)` runs the batches, `finalize()` runs at unload. Its `config.pbtxt` must declare the
  tensors, as in Triton. `import triton_python_backend_utils as pb_utils` gets the subset in
  `pipeline.stage.triton_python_backend_utils`. A response's error becomes INVALID_ARGUMENT with its message.

  Triton hands `execute` a list of requests; here the router has already merged the requests of a batch
  into one set of arrays and the stage runtime sees no boundaries between them, so `execute` gets one
  `InferenceRequest` carrying the whole batch. A model that batches (`max_batch_size > 0`) handles that
  as it handles one Triton request of several items.

Each load imports the file afresh under a module name of its own, so `RepositoryModelLoad` picks up an
edited `model.py` while the version it replaces finishes its requests. The file is read from the
repository only (paths are confined to it) and is compiled from source each time, so no stale bytecode
is used and nothing is written into the repository. `model.py` is code that runs in the service: serve
only a repository you trust.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import re
import sys
import threading
import traceback
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import Message

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import InvalidInput, PipelineError, RepositoryError
from pipeline.protocol.model_config import (
    DETERMINISTIC_PARAMETER,
    SERVED_FIELDS,
    check_response_cache,
    log_ignored,
    parameters_of,
    set_tensor_specs,
    tensor_specs,
)
from pipeline.protocol.proto_json import message_json
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.repository import RepositoryEntry
from pipeline.stage import triton_python_backend_utils as pb_utils
from pipeline.stage.api import Stage
from pipeline.stage.backend import PreparedVersion, StageInstance

log = logging.getLogger(__name__)

#: The name a Triton `model.py` imports the utilities under.
PB_UTILS_MODULE = "triton_python_backend_utils"
#: Config fields the python backend acts on: those every service does (`pipeline.runtime.repository`); others are logged.
ACTED_ON = SERVED_FIELDS

_module_ids = itertools.count(1)


class PythonBackend:
    """Prepares the versions of `model.py` entries: a `Stage` subclass or a `TritonPythonModel`."""

    names: tuple[str, ...] = ("python",)

    def prepare(self, entry: RepositoryEntry, version: str) -> PreparedVersion:
        """Import the version's `model.py`, complete its config and create its (unloaded) instances."""
        path = entry.artifact(version)
        module = _SharedModule(import_model_file(path, entry.name, version))
        try:
            stage_class, triton_class = _model_classes(module.module, path)
            if entry.has_config:
                log_ignored(entry.config, ACTED_ON, entry.source)
            if stage_class is not None:
                return _prepare_stage(entry, version, path, stage_class, module)
            assert triton_class is not None
            return _prepare_triton(entry, version, path, triton_class, module)
        except BaseException:
            module.discard()
            raise


# ---- importing model.py ----------------------------------------------------------------------------------------


def import_model_file(path: Path, model: str, version: str) -> types.ModuleType:
    """Import `path` as a new module (a name of its own every time); `RepositoryError` naming the file, the
    line and the cause when it cannot be read or raises."""
    # A flat name: a dotted one would make pickle look for parent packages that don't exist.
    name = f"pipeline_repository_{re.sub(r'[^0-9A-Za-z_]', '_', model)}_v{version}_{next(_module_ids)}"
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise RepositoryError(f"{path}: cannot read it: {exc}") from None
    module = types.ModuleType(name)
    module.__file__ = str(path)
    # Registered while it runs, as an import would be: dataclasses, typing and pickle look classes up there.
    sys.modules[PB_UTILS_MODULE] = pb_utils
    sys.modules[name] = module
    try:
        # Compiled from the source each time: a cached .pyc could be stale (its mtime has one-second
        # resolution) and would be written into the repository.
        exec(compile(source, str(path), "exec"), module.__dict__)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(name, None)
        raise RepositoryError(f"{path}: cannot import it: {_where(exc, path)}{_cause(exc)}") from None
    return module


def _cause(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _where(exc: BaseException, path: Path) -> str:
    """ "line N (`source`): " for the last line of `path` the error passed through."""
    if isinstance(exc, SyntaxError) and exc.filename == str(path) and exc.lineno:
        text = (exc.text or "").strip()
        return f"line {exc.lineno}{f' (`{text}`)' if text else ''}: "
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
    if not frames:
        return ""
    frame = frames[-1]
    return f"line {frame.lineno}{f' (`{frame.line}`)' if frame.line else ''}: "


def _model_classes(module: types.ModuleType, path: Path) -> tuple[type[Stage] | None, type | None]:
    """The one `Stage` subclass the file defines, or its `TritonPythonModel`; `RepositoryError` otherwise."""
    own = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, Stage) and obj.__module__ == module.__name__
    ]
    stages = [cls for cls in own if not inspect.isabstract(cls)]
    triton = vars(module).get("TritonPythonModel")
    if own and not stages and triton is None:
        missing = ", ".join(sorted(getattr(own[-1], "__abstractmethods__", ())))
        raise RepositoryError(
            f"{path}: Stage subclass {own[-1].__name__} is abstract: it does not implement {missing}"
        )
    if triton is not None and not isinstance(triton, type):
        raise RepositoryError(f"{path}: TritonPythonModel is a {type(triton).__name__}, not a class")
    if len(stages) > 1:
        raise RepositoryError(
            f"{path}: defines {len(stages)} Stage subclasses ({', '.join(s.__name__ for s in stages)}); "
            "a model.py defines exactly one"
        )
    if stages and triton is not None:
        raise RepositoryError(
            f"{path}: defines both a Stage subclass ({stages[0].__name__}) and TritonPythonModel; a model.py "
            "defines one or the other"
        )
    if not stages and triton is None:
        raise RepositoryError(
            f"{path}: defines no Stage subclass and no TritonPythonModel class; a model.py defines exactly one "
            "of them (a Stage subclass imported from elsewhere does not count)"
        )
    return (stages[0] if stages else None), triton


class _SharedModule:
    """An imported `model.py`, kept in `sys.modules` while any of its instances is loaded."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self._users = 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self.discard()

    def discard(self) -> None:
        if sys.modules.get(self.module.__name__) is self.module:
            del sys.modules[self.module.__name__]


# ---- placement ---------------------------------------------------------------------------------------------------


def _placements(config: mc.ModelConfig) -> list[tuple[str, str, int]]:
    """(instance name, kind "CPU" or "GPU", device id) of each instance `instance_group` asks for; groups
    are named where the config leaves them unnamed (Triton's `<model>_<index>`). One CPU instance without
    a group."""
    if not config.instance_group:
        config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    placed = []
    for index, group in enumerate(config.instance_group):
        group.name = group.name or f"{config.name}_{index}"
        group.count = max(group.count, 1)
        if group.kind == mc.ModelInstanceGroup.KIND_GPU:
            gpus = list(group.gpus) or [0]
            del group.gpus[:]
            group.gpus.extend(gpus)
            for gpu in gpus:
                placed += [(f"{group.name}_{k}", "GPU", gpu) for k in range(group.count)]
        else:
            group.kind = mc.ModelInstanceGroup.KIND_CPU
            placed += [(f"{group.name}_{k}", "CPU", 0) for k in range(group.count)]
    return placed


def _device(kind: str, device_id: int) -> str:
    return f"cuda:{device_id}" if kind == "GPU" else "cpu"


# ---- Stage subclasses --------------------------------------------------------------------------------------------


def _prepare_stage(
    entry: RepositoryEntry, version: str, path: Path, cls: type[Stage], module: _SharedModule
) -> PreparedVersion:
    config = mc.ModelConfig()
    config.CopyFrom(entry.config)
    placements = _placements(config)
    stages = []
    for _ in placements:
        try:
            stage = cls()
        except Exception as exc:
            raise RepositoryError(
                f"{path}: {cls.__name__}() failed: {_where(exc, path)}{_cause(exc)}"
            ) from None
        stages.append(stage)

    # The first object's attributes: a class may set its declarations in `__init__`.
    first = stages[0]
    config.backend = "python"
    config.platform = config.platform or first.platform or "python"
    class_batch = int(getattr(first, "max_batch_size", 0) or 0)
    config.max_batch_size = config.max_batch_size or class_batch
    # The class's word on caching, published in its ModelConfig for the router, unless the config says.
    if not getattr(first, "deterministic", True) and DETERMINISTIC_PARAMETER not in config.parameters:
        config.parameters[DETERMINISTIC_PARAMETER].string_value = "false"
    if getattr(first, "response_cache", False) and not config.HasField("response_cache"):
        config.response_cache.enable = True
    check_response_cache(config, f"{entry.source} with {path}")
    parameters = types.MappingProxyType(parameters_of(config))
    declared = (tuple(getattr(first, "inputs", ())), tuple(getattr(first, "outputs", ())))
    if config.input or config.output:
        inputs, outputs = _agreed(
            tensor_specs(config, entry.source), declared, class_batch, config, entry, path
        )
    elif declared[0] or declared[1]:
        if (class_batch > 0) != (config.max_batch_size > 0):
            raise RepositoryError(
                f"{entry.source}: max_batch_size {config.max_batch_size} disagrees with {path}: "
                f"{cls.__name__} declares max_batch_size {class_batch}, so its tensor shapes "
                f"{'have' if class_batch > 0 else 'lack'} a batch dimension; declare the tensors in the config "
                "too, or change max_batch_size"
            )
        inputs, outputs = declared
    else:
        raise RepositoryError(
            f"{path}: {cls.__name__} declares no inputs or outputs, and {entry.source} none either: declare "
            "them on the class (inputs = (TensorSpec(...),)) or in config.pbtxt (input [...], output [...])"
        )
    set_tensor_specs(config, inputs, outputs)
    for stage in stages:
        stage.name = entry.name
        stage.inputs, stage.outputs = inputs, outputs
        stage.max_batch_size = config.max_batch_size
        stage.versions = (version,)
        stage.parameters = parameters
    instances = [
        _StageFileInstance(stage, _device(kind, device_id), path, module)
        for stage, (_, kind, device_id) in zip(stages, placements, strict=True)
    ]
    return PreparedVersion(config, list(instances))


def _agreed(
    configured: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]],
    declared: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]],
    class_batch: int,
    config: mc.ModelConfig,
    entry: RepositoryEntry,
    path: Path,
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The config's tensors, checked against the class's where it declares any; pad values of the class
    carry over where the config sets none."""
    result = []
    for kind, mine, theirs in (("input", configured[0], declared[0]), ("output", configured[1], declared[1])):
        if not theirs:
            result.append(mine)
            continue
        by_name = {spec.name: spec for spec in theirs}
        if set(by_name) != {spec.name for spec in mine}:
            raise RepositoryError(
                f"{entry.source}: its {kind}s ({', '.join(s.name for s in mine) or 'none'}) differ from those "
                f"{path} declares ({', '.join(by_name) or 'none'})"
            )
        merged = []
        for spec in mine:
            other = by_name[spec.name]
            # The class's shapes carry the batch dimension when the class batches; compare the rest.
            other_dims = other.shape[1:] if class_batch > 0 else other.shape
            dims = spec.shape[1:] if config.max_batch_size > 0 else spec.shape
            if (
                other.datatype != spec.datatype
                or len(other_dims) != len(dims)
                or any(o not in (-1, d) for o, d in zip(other_dims, dims, strict=True))
            ):
                raise RepositoryError(
                    f"{entry.source}: {kind} '{spec.name}' is {spec.datatype} {list(dims)} there but "
                    f"{other.datatype} {list(other_dims)} in {path}"
                )
            if spec.pad_value is None and other.pad_value is not None:
                spec = TensorSpec(spec.name, spec.datatype, spec.shape, other.pad_value, spec.optional)
            merged.append(spec)
        result.append(tuple(merged))
    return result[0], result[1]


class _StageFileInstance:
    """One Stage object of a `model.py`: its load errors name the file."""

    def __init__(self, stage: Stage, device: str, path: Path, module: _SharedModule) -> None:
        self._adapted = StageInstance(stage, reason=f"python stage {type(stage).__name__} from {path}")
        self.stage = stage
        self.device = device
        self.reason = self._adapted.reason
        self.inline = self._adapted.inline
        self._path = path
        self._module = module
        self._loaded = False

    def load(self) -> None:
        self._module.acquire()
        self._loaded = True
        try:
            self._adapted.load()
        except Exception as exc:
            self._release()
            if isinstance(exc, PipelineError):
                raise
            raise RepositoryError(
                f"{self._path}: {type(self.stage).__name__}.load() failed: {_where(exc, self._path)}{_cause(exc)}"
            ) from exc

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._adapted.run(inputs)

    def unload(self) -> None:
        try:
            self._adapted.unload()
        finally:
            self._release()

    def _release(self) -> None:
        if self._loaded:
            self._loaded = False
            self._module.release()


# ---- TritonPythonModel -------------------------------------------------------------------------------------------


def _prepare_triton(
    entry: RepositoryEntry, version: str, path: Path, cls: type, module: _SharedModule
) -> PreparedVersion:
    if not entry.has_config or not (entry.config.input and entry.config.output):
        raise RepositoryError(
            f"{path}: a TritonPythonModel needs a config.pbtxt beside its version folders that declares its "
            f"input and output tensors, as Triton's Python backend does ({entry.folder / 'config.pbtxt'})"
        )
    if not callable(getattr(cls, "execute", None)):
        raise RepositoryError(f"{path}: TritonPythonModel has no execute(requests) method")
    config = mc.ModelConfig()
    config.CopyFrom(entry.config)
    config.backend = "python"
    config.platform = config.platform or "python"
    placements = _placements(config)
    inputs, outputs = tensor_specs(config, entry.source)
    set_tensor_specs(config, inputs, outputs)
    model_config = json.dumps(triton_json(config))
    instances = []
    for instance_name, kind, device_id in placements:
        args = {
            "model_config": model_config,
            "model_instance_kind": kind,
            "model_instance_name": instance_name,
            "model_instance_device_id": str(device_id),
            "model_repository": str(entry.folder),
            "model_version": version,
            "model_name": entry.name,
        }
        instances.append(
            _TritonInstance(
                cls, args, [spec.name for spec in outputs], _device(kind, device_id), path, module
            )
        )
    return PreparedVersion(config, list(instances))


def triton_json(message: Message) -> dict[str, Any]:
    """A config as Triton's Python backend hands it to `initialize`: protobuf's JSON mapping in the proto's
    field names, every field present, and 64-bit integers as numbers (protobuf writes them as strings; Triton
    converts them back)."""
    return message_json(message, every_field=True)


class _TritonInstance:
    """One instance of a `TritonPythonModel`: `initialize` at load, `execute` per batch, `finalize` at unload."""

    inline = False

    def __init__(
        self,
        cls: type,
        args: dict[str, str],
        outputs: list[str],
        device: str,
        path: Path,
        module: _SharedModule,
    ) -> None:
        self.device = device
        self.reason = f"Triton Python model (TritonPythonModel) from {path}"
        self._cls = cls
        self._args = args
        self._outputs = outputs
        self._path = path
        self._module = module
        self._model: Any = None

    def load(self) -> None:
        self._module.acquire()
        try:
            model = self._cls()
            initialize = getattr(model, "initialize", None)
            if initialize is not None:
                initialize(dict(self._args))
        except Exception as exc:
            self._module.release()
            raise RepositoryError(
                f"{self._path}: TritonPythonModel.initialize failed: {_where(exc, self._path)}{_cause(exc)}"
            ) from exc
        self._model = model

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        request = pb_utils.InferenceRequest(
            model_name=self._args["model_name"],
            inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()],
            requested_output_names=self._outputs,
        )
        try:
            responses = self._model.execute([request])
        except pb_utils.TritonModelException as exc:
            raise InvalidInput(str(exc)) from None
        if not isinstance(responses, list | tuple) or len(responses) != 1:
            raise PipelineError(
                f"{self._path}: TritonPythonModel.execute must return a list of one InferenceResponse per "
                f"request; for 1 request it returned {_describe(responses)}"
            )
        response = responses[0]
        if not isinstance(response, pb_utils.InferenceResponse):
            raise PipelineError(
                f"{self._path}: TritonPythonModel.execute returned {_describe(response)} instead of an "
                "InferenceResponse"
            )
        error = response.error()
        if error is not None:
            raise InvalidInput(error.message())
        outputs = {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}
        missing = [name for name in self._outputs if name not in outputs]
        if missing:
            raise PipelineError(
                f"{self._path}: TritonPythonModel.execute returned no output {', '.join(missing)} "
                f"(it returned: {', '.join(outputs) or 'none'})"
            )
        return {name: np.asarray(outputs[name]) for name in self._outputs}

    def unload(self) -> None:
        model, self._model = self._model, None
        if model is None:
            return
        try:
            finalize = getattr(model, "finalize", None)
            if finalize is not None:
                finalize()
        finally:
            self._module.release()


def _describe(value: object) -> str:
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__

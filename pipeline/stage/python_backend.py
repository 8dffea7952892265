"""The python backend: stages written in Python, served from a model repository.

    <repository>/<model>/config.pbtxt      # optional for a Stage subclass and an auto-completing TritonPythonModel
    <repository>/<model>/1/model.py

A `model.py` defines either

- exactly one subclass of `pipeline.stage.api.Stage` (defined in that file; subclasses it imports don't count).
  The model is named after its folder. The class declares its tensors, `max_batch_size` and `inline`; a
  `config.pbtxt` may declare them too, and where it declares tensors it wins, as Triton users expect: the
  class's declarations, if it has any, must then agree with it (same names and datatypes; a dimension the
  class leaves -1 the config may fix). A `max_batch_size` of 0 in the config (or none) keeps the class's.
  The config's `parameters` reach the stage as `Stage.parameters` (strings), set before `load()`.
  A class whose `infer` is a generator (or an async generator) is decoupled: each yield is a response.
  `instance_group` `count` gives that many Stage objects, each loaded and run on a thread of its own.
- or a `TritonPythonModel`, as written for Triton's Python backend, unmodified: `initialize(args)` gets
  Triton's args (`model_config` as JSON in Triton's field names, `model_instance_kind`,
  `model_instance_name`, `model_instance_device_id`, `model_repository`, `model_version`, `model_name`),
  `execute(requests)` runs the batches, `finalize()` runs at unload. Its `config.pbtxt` must declare the
  tensors, as in Triton, unless its `auto_complete_config` does. `import triton_python_backend_utils as
  pb_utils` gets `pipeline.stage.triton_python_backend_utils`; `pipeline.stage.triton_model` says how its
  errors are answered.

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
import logging
import types
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.config_fields import acted_on
from pipeline.protocol.errors import PipelineError, RepositoryError
from pipeline.protocol.model_config import (
    DETERMINISTIC_PARAMETER,
    check_response_cache,
    log_ignored,
    parameters_of,
    set_tensor_specs,
    tensor_specs,
)
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.repository import RepositoryEntry
from pipeline.stage.api import NO_DEADLINE, Deadline, Stage
from pipeline.stage.backend import (
    PreparedVersion,
    ResponseSink,
    StageInstance,
    is_generator_stage,
)
from pipeline.stage.model_file import (
    SharedModule,
    cause,
    device_of,
    import_model_file,
    instance_placements,
    where,
)
from pipeline.stage.triton_model import prepare_triton

log = logging.getLogger(__name__)

#: Config fields the python backend acts on (`pipeline.protocol.config_fields`); others are logged.
ACTED_ON = acted_on("python")


class PythonBackend:
    """Prepares the versions of `model.py` entries: a `Stage` subclass or a `TritonPythonModel`. Instances of
    kind `KIND_GPU` go on the `gpus` visible GPUs (None: as many as torch sees), or on the CPU where there
    are none (`pipeline.stage.model_file.instance_placements`)."""

    names: tuple[str, ...] = ("python",)

    def __init__(self, gpus: int | None = None) -> None:
        self.gpus = gpus

    def prepare(self, entry: RepositoryEntry, version: str) -> PreparedVersion:
        """Import the version's `model.py`, complete its config and create its (unloaded) instances."""
        path = entry.artifact(version)
        module = SharedModule(import_model_file(path, entry.name, version))
        try:
            stage_class, triton_class = _model_classes(module.module, path)
            if entry.has_config:
                log_ignored(entry.config, ACTED_ON, entry.source)
            if stage_class is not None:
                return _prepare_stage(entry, version, path, stage_class, module, self.gpus)
            assert triton_class is not None
            return prepare_triton(entry, version, path, triton_class, module, self.gpus)
        except BaseException:
            module.discard()
            raise


# ---- the model class of a model.py -----------------------------------------------------------------------------


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


# ---- Stage subclasses --------------------------------------------------------------------------------------------


def _prepare_stage(
    entry: RepositoryEntry, version: str, path: Path, cls: type[Stage], module: SharedModule, gpus: int | None
) -> PreparedVersion:
    config = mc.ModelConfig()
    config.CopyFrom(entry.config)
    placements = instance_placements(config, entry.source, gpus)
    stages = []
    for _ in placements:
        try:
            stage = cls()
        except Exception as exc:
            raise RepositoryError(
                f"{path}: {cls.__name__}() failed: {where(exc, path)}{cause(exc)}"
            ) from None
        stages.append(stage)
    # The first object's attributes: a class may set its declarations in `__init__`.
    first = stages[0]
    _complete_config(config, first, entry, path)
    parameters = types.MappingProxyType(parameters_of(config))
    inputs, outputs = _tensors(config, first, entry, path)
    set_tensor_specs(config, inputs, outputs)
    for stage in stages:
        stage.name = entry.name
        stage.inputs, stage.outputs = inputs, outputs
        stage.max_batch_size = config.max_batch_size
        stage.versions = (version,)
        stage.parameters = parameters
    instances = [
        _StageFileInstance(stage, device_of(kind, device_id), path, module)
        for stage, (_, kind, device_id) in zip(stages, placements, strict=True)
    ]
    return PreparedVersion(config, list(instances))


def _complete_config(config: mc.ModelConfig, first: Stage, entry: RepositoryEntry, path: Path) -> None:
    """What the config leaves out, from the class: its platform, batch size, caching and streaming."""
    cls = type(first)
    config.backend = "python"
    config.platform = config.platform or first.platform or "python"
    config.max_batch_size = config.max_batch_size or int(getattr(first, "max_batch_size", 0) or 0)
    # The class's word on caching, published in its ModelConfig for the router, unless the config says.
    if not getattr(first, "deterministic", True) and DETERMINISTIC_PARAMETER not in config.parameters:
        config.parameters[DETERMINISTIC_PARAMETER].string_value = "false"
    if getattr(first, "response_cache", False) and not config.HasField("response_cache"):
        config.response_cache.enable = True
    check_response_cache(config, f"{entry.source} with {path}")
    if config.model_transaction_policy.decoupled and not is_generator_stage(first):
        raise RepositoryError(
            f"{entry.source}: model_transaction_policy {{ decoupled: true }}, but {cls.__name__}.infer in "
            f"{path} returns its outputs; a decoupled Stage's infer is a generator that yields each response"
        )
    if is_generator_stage(first):
        config.model_transaction_policy.decoupled = True


def _tensors(
    config: mc.ModelConfig, first: Stage, entry: RepositoryEntry, path: Path
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The model's inputs and outputs: the config's, checked against the class's where both declare them,
    else the class's."""
    cls = type(first)
    class_batch = int(getattr(first, "max_batch_size", 0) or 0)
    declared = (tuple(getattr(first, "inputs", ())), tuple(getattr(first, "outputs", ())))
    if config.input or config.output:
        return _agreed(tensor_specs(config, entry.source), declared, class_batch, config, entry, path)
    if not (declared[0] or declared[1]):
        raise RepositoryError(
            f"{path}: {cls.__name__} declares no inputs or outputs, and {entry.source} none either: declare "
            "them on the class (inputs = (TensorSpec(...),)) or in config.pbtxt (input [...], output [...])"
        )
    if (class_batch > 0) != (config.max_batch_size > 0):
        raise RepositoryError(
            f"{entry.source}: max_batch_size {config.max_batch_size} disagrees with {path}: "
            f"{cls.__name__} declares max_batch_size {class_batch}, so its tensor shapes "
            f"{'have' if class_batch > 0 else 'lack'} a batch dimension; declare the tensors in the config "
            "too, or change max_batch_size"
        )
    return declared


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

    def __init__(self, stage: Stage, device: str, path: Path, module: SharedModule) -> None:
        self._adapted = StageInstance(stage, reason=f"python stage {type(stage).__name__} from {path}")
        self.stage = stage
        self.device = device
        self.reason = self._adapted.reason
        self.inline = self._adapted.inline
        self.inline_when_brief = False
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
                f"{self._path}: {type(self.stage).__name__}.load() failed: {where(exc, self._path)}{cause(exc)}"
            ) from exc

    def run(
        self, inputs: Mapping[str, np.ndarray], deadline: Deadline = NO_DEADLINE
    ) -> dict[str, np.ndarray]:
        return self._adapted.run(inputs, deadline)

    def run_decoupled(self, inputs: Mapping[str, np.ndarray], deadline: Deadline, sink: ResponseSink) -> None:
        self._adapted.run_decoupled(inputs, deadline, sink)

    def unload(self) -> None:
        try:
            self._adapted.unload()
        finally:
            self._release()

    def _release(self) -> None:
        if self._loaded:
            self._loaded = False
            self._module.release()

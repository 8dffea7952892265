"""A repository's `model.py`, imported, and what the instances of a python model share: the module, kept while
any of them is loaded; their placement from `instance_group`; and errors that name the file and the line."""

from __future__ import annotations

import itertools
import logging
import re
import sys
import threading
import traceback
import types
from pathlib import Path

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import RepositoryError
from pipeline.stage import triton_python_backend_utils as pb_utils

#: The name a Triton `model.py` imports the utilities under.
PB_UTILS_MODULE = "triton_python_backend_utils"

log = logging.getLogger(__name__)

_module_ids = itertools.count(1)


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
        raise RepositoryError(f"{path}: cannot import it: {where(exc, path)}{cause(exc)}") from None
    return module


def cause(exc: BaseException) -> str:
    """An exception as a message names it: its type and text."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def where(exc: BaseException, path: Path) -> str:
    """ "line N (`source`): " for the last line of `path` the error passed through."""
    if isinstance(exc, SyntaxError) and exc.filename == str(path) and exc.lineno:
        text = (exc.text or "").strip()
        return f"line {exc.lineno}{f' (`{text}`)' if text else ''}: "
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
    if not frames:
        return ""
    frame = frames[-1]
    return f"line {frame.lineno}{f' (`{frame.line}`)' if frame.line else ''}: "


class SharedModule:
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


def instance_placements(
    config: mc.ModelConfig, source: str, gpus: int | None = None
) -> list[tuple[str, str, int]]:
    """(instance name, kind "CPU" or "GPU", device id) of each instance `instance_group` asks for, and the
    groups rewritten as placed (what `ModelConfig` then reports); groups are named where the config leaves
    them unnamed (Triton's `<model>_<index>`). One CPU instance without a group.

    A `KIND_GPU` group's instances run on GPUs, as in Triton (see `_on_gpus`); where no GPU is visible they
    run on the CPU instead (logged), as the model service runs a model of `KIND_AUTO` there. `gpus` is how
    many are visible (None: torch counts them, only if a group asks for GPUs)."""
    if not config.instance_group:
        config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    placed = []
    for index, group in enumerate(config.instance_group):
        group.name = group.name or f"{config.name}_{index}"
        group.count = max(group.count, 1)
        if group.kind == mc.ModelInstanceGroup.KIND_GPU:
            gpus = visible_gpus() if gpus is None else gpus
            if gpus > 0:
                placed += _on_gpus(group, gpus, source)
                continue
            log.warning(
                "%s: instance_group '%s' asks for KIND_GPU, but no CUDA GPU is visible: its %d instance(s) run "
                "on the CPU",
                source,
                group.name,
                group.count,
            )
            del group.gpus[:]
        group.kind = mc.ModelInstanceGroup.KIND_CPU
        placed += [(f"{group.name}_{k}", "CPU", 0) for k in range(group.count)]
    return placed


def _on_gpus(group: mc.ModelInstanceGroup, gpus: int, source: str) -> list[tuple[str, str, int]]:
    """A `KIND_GPU` group's instances: `count` on each GPU it lists, or spread round robin over the visible
    GPUs when it lists none (as the model service places its other models)."""
    unknown = [gpu for gpu in group.gpus if not 0 <= gpu < gpus]
    if unknown:
        raise RepositoryError(
            f"{source}: instance_group '{group.name}' names GPU(s) {unknown}, but {gpus} are visible "
            f"(0..{gpus - 1})"
        )
    on = [gpu for gpu in group.gpus for _ in range(group.count)] or [k % gpus for k in range(group.count)]
    return [(f"{group.name}_{k}", "GPU", gpu) for k, gpu in enumerate(on)]


def visible_gpus() -> int:
    """CUDA GPUs that torch sees; 0 where torch is not installed."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_of(kind: str, device_id: int) -> str:
    return f"cuda:{device_id}" if kind == "GPU" else "cpu"

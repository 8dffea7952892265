"""The TensorRT runner: `.plan` engines as they are, and engines built from ONNX or PyTorch files, cached.

An ONNX file is parsed as it is; a TorchScript module or `torch.export` program is first exported to ONNX
(its inputs named as the model's, its outputs as the config's). The engine is built with one optimisation
profile: batch 1 to `max_batch_size` (opt: the largest `preferred_batch_size`, else the max), and every other
variable dimension over the range the model file gives (a `torch.export` program's), else refused with the
tensor named. Built engines are cached on disk under a key made of the model file's hash, the precision, the
TensorRT version, the GPU's name and the profile: any of them changing builds a new engine, nothing else does.

TensorRT 10 has an FP16 builder flag; TensorRT 11 builds strongly typed networks only, so FP16 there needs a
model file in FP16, and a request for FP16 from an FP32 file is refused with that reason.

It runs with the name-based tensor API: per call `set_input_shape` and `set_tensor_address` for each I/O
tensor, then `execute_async_v3` on the instance's own CUDA stream. Device buffers are torch CUDA tensors
allocated once at the profile's largest shapes and reused.

Everything but loading, building and running (which need TensorRT and a GPU) runs anywhere: the cache key,
the cache, the profile and the ONNX export are tested on the CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.protocol.errors import RepositoryError
from services.model.artifacts import (
    ONNX,
    TENSORRT_PLAN,
    Binding,
    Signature,
    Tensor,
    export_onnx,
)
from services.model.instances import ArtifactInstance

log = logging.getLogger(__name__)

#: Workspace TensorRT may use while building, unless the config's max_workspace_size_bytes says otherwise.
WORKSPACE_BYTES = 1 << 30
#: Where engines go when nothing says otherwise.
DEFAULT_CACHE = Path.home() / ".cache" / "pipeline" / "engines"
PRECISIONS = ("fp32", "fp16")

#: One tensor's optimisation profile: its (min, opt, max) shapes.
Profile = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def tensorrt_status() -> tuple[bool, str]:
    """Whether TensorRT can run here, and why (or why not). Tests replace it to play other machines."""
    try:
        import tensorrt
    except ImportError:
        return False, "the tensorrt package is not installed (pip install 'pipeline-serving[gpu]')"
    except Exception as exc:  # a broken CUDA install raises OSError and friends at import
        return False, f"tensorrt does not import: {exc}"
    import torch

    if not torch.cuda.is_available():
        return False, f"TensorRT {tensorrt.__version__} is installed but no CUDA GPU is visible"
    return True, f"TensorRT {tensorrt.__version__} and a CUDA GPU are present"


def optimization_profile(
    inputs: list[tuple[str, tuple[int, ...]]],
    ranges: Mapping[str, Mapping[int, tuple[int, int]]],
    *,
    max_batch_size: int,
    preferred_batch_size: int = 0,
    source: str = "",
) -> Profile:
    """(min, opt, max) shapes of every input (name, full shape with -1 where it varies): the batch from 1 to
    `max_batch_size` (opt: the preferred batch, else the max), other variable dimensions over `ranges` (opt:
    their upper bound); `RepositoryError` for a variable dimension without a bound."""
    opt_batch = min(max(1, preferred_batch_size or max_batch_size), max_batch_size) if max_batch_size else 1
    profile: Profile = {}
    for name, shape in inputs:
        low, opt, high = [], [], []
        for axis, size in enumerate(shape):
            if axis == 0 and max_batch_size > 0:
                low.append(1)
                opt.append(opt_batch)
                high.append(max_batch_size)
            elif size == -1:
                bounds = ranges.get(name, {}).get(axis)
                if not bounds or not bounds[1]:
                    raise RepositoryError(
                        f"{source}: input '{name}' dimension {axis} varies and the model file gives no upper "
                        "bound for it, which a TensorRT profile needs; use runner onnxruntime or torch"
                    )
                low.append(bounds[0])
                opt.append(bounds[1])
                high.append(bounds[1])
            else:
                low.append(size)
                opt.append(size)
                high.append(size)
        profile[name] = (tuple(low), tuple(opt), tuple(high))
    return profile


@dataclass(frozen=True, slots=True)
class EngineKey:
    """What a built engine depends on; `digest` names its cache file."""

    model: str
    model_hash: str
    precision: str
    tensorrt: str
    gpu: str
    profile: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]

    @classmethod
    def of(
        cls, model: str, model_hash: str, precision: str, tensorrt: str, gpu: str, profile: Profile
    ) -> EngineKey:
        """A key from its parts (the profile in a canonical order)."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}")
        return cls(
            model,
            model_hash,
            precision,
            tensorrt,
            gpu,
            tuple((n, tuple(s)) for n, s in sorted(profile.items())),
        )

    @property
    def digest(self) -> str:
        """sha256 of every field, canonically encoded."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


class EngineCache:
    """Serialised engines on disk, `<folder>/<model>/<key digest>.plan` beside a `.json` of the key.

    Writes go to a temporary file then `os.replace`, so a reader never sees half an engine, and two services
    building the same engine at once both end with a whole one.
    """

    def __init__(self, folder: str | os.PathLike[str] | None = None) -> None:
        self.folder = Path(folder or DEFAULT_CACHE)

    def path(self, key: EngineKey) -> Path:
        """Where the engine for `key` lives (whether or not it exists)."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key.model) or "model"
        return self.folder / safe / f"{key.digest}.plan"

    def lookup(self, key: EngineKey) -> bytes | None:
        """The cached engine for `key`, or None when there is none (or it cannot be read)."""
        path = self.path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read cached engine %s (%s); rebuilding it", path, exc)
            return None

    def store(self, key: EngineKey, plan: bytes) -> Path:
        """Write an engine (and its key, for people) under `key`; returns its path."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        for target, data in (
            (path.with_suffix(".json"), json.dumps(asdict(key), indent=1).encode()),
            (path, plan),
        ):
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".partial-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        return path

    def entries(self, model: str | None = None) -> list[Path]:
        """The cached engines (of one model, or all)."""
        return sorted(self.folder.glob("*/*.plan" if model is None else f"{model}/*.plan"))


def file_digest(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_engine(
    onnx_path: Path, profile: Profile, *, precision: str, workspace_bytes: int | None = None
) -> bytes:  # pragma: no cover - needs TensorRT and a GPU
    """Parse the ONNX file and build a serialised engine with one optimisation profile."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    fp16_flag = getattr(trt.BuilderFlag, "FP16", None)
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    flags = 0
    if precision == "fp16":
        if fp16_flag is None:
            raise RepositoryError(
                f"{onnx_path}: FP16 asked for, but TensorRT {trt.__version__} builds strongly typed networks only: "
                "give a model file in FP16, or precision_mode FP32"
            )
    elif strongly_typed is not None:
        flags |= 1 << int(strongly_typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RepositoryError(f"{onnx_path}: TensorRT cannot parse it: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes or WORKSPACE_BYTES)
    if precision == "fp16":
        config.set_flag(fp16_flag)
    shapes = builder.create_optimization_profile()
    for name, (low, opt, high) in profile.items():
        shapes.set_shape(name, low, opt, high)
    config.add_optimization_profile(shapes)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RepositoryError(f"{onnx_path}: TensorRT could not build an engine from it (see the log)")
    return bytes(plan)


def plan_signature(path: Path) -> Signature:  # pragma: no cover - needs TensorRT and a GPU
    """A TensorRT engine's I/O tensors: names, datatypes, shapes (-1 where they vary) and profile ranges."""
    import tensorrt as trt

    engine = _deserialize(path.read_bytes(), str(path))
    inputs, outputs, ranges = [], [], {}
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        shape = tuple(int(d) for d in engine.get_tensor_shape(name))
        tensor = Tensor(name, _datatype(trt, engine.get_tensor_dtype(name)), shape)
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            inputs.append(tensor)
            low, _, high = engine.get_tensor_profile_shape(name, 0)
            ranges[name] = {a: (int(low[a]), int(high[a])) for a, d in enumerate(shape) if d == -1}
        else:
            outputs.append(tensor)
    batch_highs = [r[0][1] for r in ranges.values() if 0 in r]
    return Signature(tuple(inputs), tuple(outputs), max_batch=min(batch_highs, default=0), ranges=ranges)


def _deserialize(plan: bytes, where: str) -> Any:  # pragma: no cover - needs TensorRT and a GPU
    import tensorrt as trt

    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan)
    if engine is None:
        raise RepositoryError(
            f"{where}: TensorRT cannot deserialise it (corrupt, or built by another TensorRT version or GPU)"
        )
    return engine


class TensorRTInstance(ArtifactInstance):  # pragma: no cover - needs TensorRT and a GPU; tests/gpu runs it
    """A model as a TensorRT engine on one GPU: a `.plan` file, or an engine built from the model file.

    Args:
        kind: the model file's kind (an engine, ONNX, TorchScript or `torch.export`).
        signature: the model file's signature (variable dimension ranges for the profile).
        precision: "fp32" or "fp16" (built engines only).
        max_batch_size, preferred_batch_size: the profile's batch range and opt batch.
        cache_dir: the engine cache's folder.
        model: the model's name (the cache's subfolder).
    """

    def __init__(
        self,
        *args: Any,
        kind: str,
        signature: Signature,
        precision: str = "fp32",
        max_batch_size: int = 0,
        preferred_batch_size: int = 0,
        cache_dir: Path | None = None,
        workspace_bytes: int | None = None,
        model: str = "",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.kind = kind
        self.signature = signature
        self.precision = precision
        self.max_batch_size = max_batch_size
        self.preferred_batch_size = preferred_batch_size
        self.cache = EngineCache(cache_dir)
        self.workspace_bytes = workspace_bytes
        self.model = model or self.artifact.parent.parent.name
        self.engine_path: Path | None = None
        self._engine: Any = None
        self._context: Any = None
        self._stream: Any = None
        self._buffers: dict[str, Any] = {}
        self._profile: Profile = {}

    def _names(self, binding: Binding) -> str:
        return binding.model_name or binding.name

    def _load(self) -> None:
        import tensorrt as trt
        import torch

        device = torch.device(self.device)
        with torch.cuda.device(device):
            if self.kind == TENSORRT_PLAN:
                plan = self.artifact.read_bytes()
                self.engine_path = self.artifact
            else:
                plan = self._cached_engine(trt, torch.cuda.get_device_name(device))
            self._engine = _deserialize(plan, str(self.engine_path))
            self._context = self._engine.create_execution_context()
            self._stream = torch.cuda.Stream(device)
            self._allocate(trt, device)
        log.info(
            "loaded %s as TensorRT %s engine %s on %s (%s)",
            self.artifact,
            trt.__version__,
            self.engine_path,
            self.device,
            self.reason,
        )

    def _cached_engine(self, trt: Any, gpu: str) -> bytes:
        shapes = [(self._names(b), b.model_shape) for b in self.bindings.inputs]
        ranges = {self._names(b): self.signature.ranges.get(b.model_name, {}) for b in self.bindings.inputs}
        self._profile = optimization_profile(
            shapes,
            ranges,
            max_batch_size=self.max_batch_size,
            preferred_batch_size=self.preferred_batch_size,
            source=str(self.artifact),
        )
        key = EngineKey.of(
            self.model, file_digest(self.artifact), self.precision, trt.__version__, gpu, self._profile
        )
        self.engine_path = self.cache.path(key)
        plan = self.cache.lookup(key)
        if plan is not None:
            return plan
        with tempfile.TemporaryDirectory(prefix="pipeline-onnx-") as tmp:
            onnx_path = self.artifact
            if self.kind != ONNX:
                onnx_path = export_onnx(
                    self.artifact,
                    self.kind,
                    list(self.bindings.inputs),
                    list(self.bindings.outputs),
                    Path(tmp) / "model.onnx",
                    batching=self.batching,
                )
            log.info("%s: building a TensorRT engine, profile %s", self.artifact, self._profile)
            plan = build_engine(
                onnx_path, self._profile, precision=self.precision, workspace_bytes=self.workspace_bytes
            )
        try:
            log.info("%s: engine built and cached at %s", self.artifact, self.cache.store(key, plan))
        except OSError as exc:  # a read-only repository: the engine serves, and is built again next time
            log.warning(
                "%s: engine built but not cached (%s); set --engine-cache to a writable folder",
                self.artifact,
                exc,
            )
        return plan

    def _allocate(self, trt: Any, device: Any) -> None:
        """One device buffer per I/O tensor, at its largest shape under the profile."""
        import torch

        for binding in self.bindings.inputs:
            name = self._names(binding)
            high = self._engine.get_tensor_profile_shape(name, 0)[2]
            self._context.set_input_shape(name, tuple(high))
        for binding in (*self.bindings.inputs, *self.bindings.outputs):
            name = self._names(binding)
            dtype = _torch_dtype(trt, self._engine.get_tensor_dtype(name))
            shape = tuple(self._context.get_tensor_shape(name))
            self._buffers[name] = torch.empty(int(np.prod(shape)), dtype=dtype, device=device)

    def _run(self, feeds: Mapping[Binding, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        context, stream = self._context, self._stream
        if context is None or stream is None:
            raise RuntimeError("TensorRTInstance.run called before load()")
        with torch.cuda.device(torch.device(self.device)), torch.cuda.stream(stream), torch.inference_mode():
            for binding, array in feeds.items():
                name = self._names(binding)
                host = torch.from_numpy(np.ascontiguousarray(array))
                view = self._buffers[name][: host.numel()].view(host.shape)
                view.copy_(host)  # casts to the engine's type on the device
                context.set_input_shape(name, tuple(host.shape))
                context.set_tensor_address(name, view.data_ptr())
            outputs = {}
            for binding in self.bindings.outputs:
                name = self._names(binding)
                shape = tuple(context.get_tensor_shape(name))
                view = self._buffers[name][: int(np.prod(shape))].view(shape)
                context.set_tensor_address(name, view.data_ptr())
                outputs[binding.name] = view
            if not context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError(f"TensorRT execution of {self.artifact} failed")
            results = {}
            for binding in self.bindings.outputs:
                view = outputs[binding.name]
                if view.is_floating_point() and self.datatypes[binding.name] == "FP32":
                    view = view.float()
                results[binding.name] = view.cpu().numpy()
            return results

    def unload(self) -> None:
        import torch

        self._context = None
        self._engine = None
        self._buffers.clear()
        self._stream = None
        torch.cuda.empty_cache()


def _datatype(trt: Any, dtype: Any) -> str:  # pragma: no cover - needs TensorRT
    table = {
        trt.float32: "FP32",
        trt.float16: "FP16",
        trt.int32: "INT32",
        trt.int64: "INT64",
        trt.int8: "INT8",
        trt.bool: "BOOL",
    }
    if getattr(trt, "bfloat16", None) is not None:
        table[trt.bfloat16] = "BF16"
    if getattr(trt, "uint8", None) is not None:
        table[trt.uint8] = "UINT8"
    return table[dtype]


def _torch_dtype(trt: Any, dtype: Any) -> Any:  # pragma: no cover - needs TensorRT
    import torch

    return {
        "FP32": torch.float32, "FP16": torch.float16, "INT32": torch.int32, "INT64": torch.int64,
        "INT8": torch.int8, "BOOL": torch.bool, "BF16": torch.bfloat16, "UINT8": torch.uint8,
    }[_datatype(trt, dtype)]  # fmt: skip

"""The TensorRT backend: ONNX export, engine build, an on-disk engine cache, and execution on a CUDA stream.

A model is exported to ONNX with a dynamic batch dimension (and its other variable dimensions), an engine is
built with one optimisation profile from batch 1 to the model's `max_batch_size` (opt at the preferred
batch), and the serialised engine is cached on disk under a key made of the model's hash (architecture,
weights, precision), the TensorRT version, the GPU's name and the profile: any of them changing builds a new
engine, nothing else does.

TensorRT 11 networks are strongly typed (no FP16 builder flag): an FP16 engine is built from an FP16 export,
so the precision lives in the ONNX graph. On TensorRT 10, which still has the flag, it is set as well.

It runs with the name-based tensor API: per call `set_input_shape` and `set_tensor_address` for each I/O
tensor, then `execute_async_v3` on the runner's own CUDA stream. Device buffers are torch CUDA tensors
allocated once at the profile's largest shapes and reused, so only the request's bytes cross the bus.

Everything but `TensorRTRunner.load`/`run` and `build_engine` (which need TensorRT and a GPU) runs anywhere:
the cache key, the cache and the ONNX export are tested on the CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from services.model.backends import PRECISIONS, ModelLoadError, to_device_inputs
from services.model.networks import Network, export_dynamic_shapes, module_digest

log = logging.getLogger(__name__)

#: Workspace TensorRT may use while building (tactics that need more are skipped).
WORKSPACE_BYTES = 1 << 30
#: Where engines go when nothing says otherwise (env PIPELINE_ENGINE_CACHE overrides).
DEFAULT_CACHE = Path.home() / ".cache" / "pipeline" / "engines"

#: One tensor's optimisation profile: its (min, opt, max) shapes.
Profile = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def optimization_profile(network: Network, max_batch_size: int, preferred_batch_size: int | None) -> Profile:
    """(min, opt, max) shapes of every input: batch 1..max_batch_size (opt: the preferred batch, else the
    largest), other variable dimensions over the network's declared ranges, fixed ones as declared."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1 for a TensorRT engine, got {max_batch_size}")
    opt_batch = min(max(1, preferred_batch_size or max_batch_size), max_batch_size)
    profile: Profile = {}
    for spec in network.inputs:
        ranges = network.dynamic.get(spec.name, {})
        low, opt, high = [1], [opt_batch], [max_batch_size]
        for axis, size in enumerate(spec.shape[1:], start=1):
            if size == -1:
                if axis not in ranges:
                    raise ValueError(f"{network.architecture}: input {spec.name} axis {axis} has no range")
                a, b, c = ranges[axis]
                low.append(a), opt.append(b), high.append(c)
            else:
                low.append(size), opt.append(size), high.append(size)
        profile[spec.name] = (tuple(low), tuple(opt), tuple(high))
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
        self.folder = Path(folder or os.environ.get("PIPELINE_ENGINE_CACHE") or DEFAULT_CACHE)

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
        pattern = "*/*.plan" if model is None else f"{model}/*.plan"
        return sorted(self.folder.glob(pattern))


def export_onnx(
    module: nn.Module,
    network: Network,
    path: str | os.PathLike[str],
    *,
    precision: str = "fp32",
    max_batch_size: int | None = None,
    device: str = "cpu",
) -> Path:
    """Export `module` (already at `precision`) to ONNX with a dynamic batch dimension (named "batch") and the
    network's other variable dimensions dynamic too. Needs the `onnx` and `onnxscript` packages (the dynamo
    exporter)."""
    path = Path(path)
    dtype = torch.float16 if precision == "fp16" else torch.float32
    # Batch 2, not 1: torch.export specialises dimensions whose example size is 1.
    example = to_device_inputs(network, network.example(2), torch.device(device), dtype)
    shapes = export_dynamic_shapes(network, max_batch_size or network.max_batch_size)
    try:
        torch.onnx.export(
            module,
            tuple(example),
            str(path),
            input_names=[s.name for s in network.inputs],
            output_names=[s.name for s in network.outputs],
            dynamic_shapes=tuple(shapes),
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    except ImportError as exc:
        raise ModelLoadError(
            f"ONNX export needs onnx and onnxscript ({exc}); pip install onnx onnxscript"
        ) from None
    return path


def build_engine(
    onnx_path: str | os.PathLike[str], profile: Profile, *, precision: str
) -> bytes:  # pragma: no cover - GPU
    """Parse the ONNX file and build a serialised engine with one optimisation profile."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if strongly_typed is not None:
        flags |= 1 << int(strongly_typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ModelLoadError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if precision == "fp16" and strongly_typed is None and hasattr(trt.BuilderFlag, "FP16"):
        config.set_flag(trt.BuilderFlag.FP16)  # TensorRT < 10.x without strong typing
    shapes = builder.create_optimization_profile()
    for name, (low, opt, high) in profile.items():
        shapes.set_shape(name, low, opt, high)
    config.add_optimization_profile(shapes)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ModelLoadError(f"TensorRT could not build an engine from {onnx_path} (see the log above)")
    return bytes(plan)


class TensorRTRunner:  # pragma: no cover - needs TensorRT and a GPU; tests/gpu runs it
    """A network as a TensorRT engine on one GPU, FP32 or FP16, through the engine cache.

    Args:
        network: what to build; `version_dir` is where its weights come from (None: built-in weights).
        device: "cuda:N".
        precision: "fp32" or "fp16" (an FP16 ONNX export; inputs are cast, outputs come back as float32).
        cache_dir: the engine cache's folder (default: env PIPELINE_ENGINE_CACHE, else ~/.cache/pipeline).
        max_batch_size: the profile's largest batch; `preferred_batch_size` its opt batch.
        reason: why this backend was chosen, repeated in the log line of `load`.
    """

    name = "tensorrt"
    platform = "tensorrt_plan"

    def __init__(
        self,
        network: Network,
        version_dir: Path | None,
        *,
        device: str = "cuda:0",
        precision: str = "fp32",
        cache_dir: str | os.PathLike[str] | None = None,
        max_batch_size: int | None = None,
        preferred_batch_size: int | None = None,
        reason: str = "",
    ) -> None:
        if not device.startswith("cuda"):
            raise ValueError(f"TensorRT runs on a GPU, not on {device!r}")
        self.network = network
        self.version_dir = version_dir
        self.device = device if ":" in device else "cuda:0"
        self.precision = precision
        self.cache = EngineCache(cache_dir)
        self.max_batch_size = max_batch_size or network.max_batch_size
        self.profile = optimization_profile(network, self.max_batch_size, preferred_batch_size)
        self.reason = reason
        self.engine_path: Path | None = None
        self.built = False
        self._torch_device = torch.device(self.device)
        self._engine: Any = None
        self._context: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._buffers: dict[str, torch.Tensor] = {}

    def load(self) -> None:
        """Find or build the engine, deserialise it, allocate the device buffers, warm up."""
        import tensorrt as trt

        with torch.cuda.device(self._torch_device):
            dtype = torch.float16 if self.precision == "fp16" else torch.float32
            module = self.network.build(self.version_dir).to(dtype).eval()
            key = EngineKey.of(
                self.network.architecture,
                module_digest(module, self.network.architecture, self.precision),
                self.precision,
                trt.__version__,
                torch.cuda.get_device_name(self._torch_device),
                self.profile,
            )
            plan = self.cache.lookup(key)
            if plan is None:
                plan = self._build(module, key)
            else:
                log.info("%s: engine from cache %s", self.network.architecture, self.cache.path(key))
            self.engine_path = self.cache.path(key)
            logger = trt.Logger(trt.Logger.WARNING)
            self._engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
            if self._engine is None:
                raise ModelLoadError(f"TensorRT cannot deserialise {self.engine_path}; delete it to rebuild")
            self._context = self._engine.create_execution_context()
            self._stream = torch.cuda.Stream(self._torch_device)
            self._allocate(trt)
        self.run(self.network.example(1))
        log.info(
            "loaded %s (%s) as a TensorRT %s engine on %s at %s (%s) (%s)",
            self.network.architecture,
            self.version_dir or "built-in weights",
            trt.__version__,
            self.device,
            self.precision,
            "built" if self.built else "cached",
            self.reason or "as configured",
        )

    def _build(self, module: nn.Module, key: EngineKey) -> bytes:
        with tempfile.TemporaryDirectory(prefix="pipeline-onnx-") as tmp:
            onnx_path = export_onnx(
                module,
                self.network,
                Path(tmp) / "model.onnx",
                precision=self.precision,
                max_batch_size=self.max_batch_size,
            )
            log.info("%s: building a TensorRT engine, profile %s", self.network.architecture, self.profile)
            plan = build_engine(onnx_path, self.profile, precision=self.precision)
        path = self.cache.store(key, plan)
        self.built = True
        log.info("%s: engine built and cached at %s", self.network.architecture, path)
        return plan

    def _allocate(self, trt: Any) -> None:
        """One device buffer per I/O tensor, at its largest shape under the profile."""
        largest = {name: shapes[2] for name, shapes in self.profile.items()}
        for name, shape in largest.items():
            self._context.set_input_shape(name, shape)
        for spec in (*self.network.inputs, *self.network.outputs):
            dtype = _torch_dtype(trt, self._engine.get_tensor_dtype(spec.name))
            shape = tuple(self._context.get_tensor_shape(spec.name))
            self._buffers[spec.name] = torch.empty(
                int(np.prod(shape)), dtype=dtype, device=self._torch_device
            )

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch: copy in, set shapes and addresses, `execute_async_v3`, copy out (one sync)."""
        context, stream = self._context, self._stream
        if context is None or stream is None:
            raise RuntimeError("TensorRTRunner.run called before load()")
        with torch.cuda.device(self._torch_device), torch.cuda.stream(stream), torch.inference_mode():
            for spec in self.network.inputs:
                host = torch.from_numpy(np.ascontiguousarray(inputs[spec.name]))
                buffer = self._buffers[spec.name]
                view = buffer[: host.numel()].view(host.shape)
                view.copy_(host)  # casts FP32 → FP16 on the device for an FP16 engine
                context.set_input_shape(spec.name, tuple(host.shape))
                context.set_tensor_address(spec.name, view.data_ptr())
            outputs = {}
            for spec in self.network.outputs:
                shape = tuple(context.get_tensor_shape(spec.name))
                view = self._buffers[spec.name][: int(np.prod(shape))].view(shape)
                context.set_tensor_address(spec.name, view.data_ptr())
                outputs[spec.name] = view
            if not context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError(f"TensorRT execution of {self.network.architecture} failed")
            return {name: view.float().cpu().numpy() for name, view in outputs.items()}

    def unload(self) -> None:
        """Free the context, engine and buffers."""
        self._context = None
        self._engine = None
        self._buffers.clear()
        self._stream = None
        torch.cuda.empty_cache()


def _torch_dtype(trt: Any, dtype: Any) -> torch.dtype:  # pragma: no cover - GPU
    table = {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.int32: torch.int32,
        trt.int64: torch.int64,
        trt.int8: torch.int8,
        trt.bool: torch.bool,
    }
    bf16 = getattr(trt, "bfloat16", None)
    if bf16 is not None:
        table[bf16] = torch.bfloat16
    return table[dtype]


def cached_engines(cache_dir: str | os.PathLike[str] | None = None) -> Sequence[Path]:
    """Every engine in the cache (for `gpu-check.sh` and people)."""
    return EngineCache(cache_dir).entries()

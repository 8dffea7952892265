"""Backends that run a network on numpy batches: TensorRT engines, PyTorch on CUDA, PyTorch on the CPU.

Two interfaces live here. `ModelBackend` (one input array, `TorchBackend`, `select_backend`) is what the
standalone `DigitsCNNStage` uses. `Runner` (named inputs and outputs) is what repository models run on:
`TorchRunner` here and `services.model.tensorrt.TensorRTRunner`, picked by `select_runner` after
`resolve_backend` has decided, and logged, which backend runs and why:

- `auto`: TensorRT when it imports and the instance is on a GPU, else torch (on the instance's device);
- `tensorrt`: TensorRT, or `BackendUnavailable` saying what is missing;
- `torch`: PyTorch on the instance's device (eager, TorchScript or `torch.export`, optionally `torch.compile`
  and CUDA graphs).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from services.model.networks import Network

log = logging.getLogger(__name__)

BACKEND_KINDS = ("auto", "torch", "tensorrt")
DEVICES = ("auto", "cpu", "cuda")

# Request tensors arrive as read-only views of the request bytes; torch warns when it wraps one because it
# cannot mark a tensor read-only. Nothing here writes to its input, so the copy the warning suggests is waste.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__
)


class BackendUnavailable(RuntimeError):
    """The backend or device asked for cannot run in this build or on this machine."""


class ModelLoadError(RuntimeError):
    """The weights are missing, unreadable or do not fit the network."""


@runtime_checkable
class ModelBackend(Protocol):
    """Runs one network on batches. `load` before the first `infer`; both block."""

    #: Triton's backend name for what runs (`ModelConfig.backend`), e.g. "pytorch", "tensorrt".
    name: str
    #: Triton's platform name (`ModelConfig.platform`), e.g. "pytorch_libtorch", "tensorrt_plan".
    platform: str
    #: Where it runs: "cpu", "cuda", "cuda:1".
    device: str

    def load(self) -> None:
        """Read the weights and warm up; raises `ModelLoadError` naming the file on failure."""
        ...

    def infer(self, batch: np.ndarray) -> np.ndarray:
        """Run one batch (float32, batch dimension first) and return the outputs on the host."""
        ...

    def unload(self) -> None:
        """Release the weights and device memory."""
        ...


class TorchBackend:
    """A PyTorch `nn.Module` in eval mode under `torch.inference_mode`, on CUDA or CPU.

    Args:
        build: makes the untrained network; its `state_dict` is then read from `weights`.
        weights: a `state_dict` file written by `torch.save`; read with `weights_only=True`, so a file from
            elsewhere can hold tensors but never code. When a `metadata.json` beside it has a `sha256`, the
            file must match it.
        device: "cpu", "cuda" or "cuda:N".
        threads: torch intra-op threads for CPU work (process-wide). 1 by default: more threads spin against
            the server's own threads on small machines and collapse throughput.
        example_shape: one input's shape (no batch dimension), used to warm up in `load`.
        reason: why this backend and device were chosen, repeated in the log line of `load` (the choice is
            often made before the service has configured logging).
    """

    name = "pytorch"
    platform = "pytorch_libtorch"

    def __init__(
        self,
        build: Callable[[], nn.Module],
        weights: str | os.PathLike[str],
        *,
        device: str = "cpu",
        threads: int = 1,
        example_shape: tuple[int, ...] | None = None,
        reason: str = "",
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.build = build
        self.weights = Path(weights)
        self.device = device
        self.threads = threads
        self.example_shape = example_shape
        self.reason = reason
        self._module: nn.Module | None = None

    def load(self) -> None:
        """Read and check the weights, move the network to the device and run one warm-up batch."""
        torch.set_num_threads(self.threads)
        device = torch.device(self.device)
        state = load_state_dict(self.weights, map_location=device)
        module = self.build()
        try:
            module.load_state_dict(state)
        except RuntimeError as exc:
            raise ModelLoadError(
                f"model weights {self.weights} do not fit the network: {exc}; run `make model` to retrain them"
            ) from None
        module.to(device).eval()
        self._module = module
        if self.example_shape is not None:
            self.infer(np.zeros((1, *self.example_shape), dtype=np.float32))
        log.info(
            "loaded %s with torch %s on %s (%s), %d intra-op thread%s",
            self.weights,
            torch.__version__,
            self.device,
            self.reason or "as configured",
            self.threads,
            "" if self.threads == 1 else "s",
        )

    def infer(self, batch: np.ndarray) -> np.ndarray:
        """Run one batch; on CPU the input and output share memory with the numpy arrays."""
        module = self._module
        if module is None:
            raise RuntimeError("TorchBackend.infer called before load()")
        # No copy when the request already holds contiguous float32, which is the usual case.
        tensor = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32))
        with torch.inference_mode():
            if self.device != "cpu":
                tensor = tensor.to(self.device, non_blocking=False)
            out = module(tensor)
            return out.cpu().numpy() if out.device.type != "cpu" else out.numpy()

    def unload(self) -> None:
        """Drop the network; on CUDA also return the cached memory."""
        self._module = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def load_state_dict(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu") -> dict:
    """Read a `state_dict` safely (`weights_only=True`), checking it against `metadata.json` if present.

    Raises `ModelLoadError` that names the file and says how to make it.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(
            f"model weights not found: {path}; run `make model` (python -m services.model.train) to train them"
        )
    expected = _expected_sha256(path)
    if expected is not None:
        actual = sha256_file(path)
        if actual != expected:
            raise ModelLoadError(
                f"model weights {path} have sha256 {actual}, but {path.parent / 'metadata.json'} says "
                f"{expected}; run `make model` to rebuild them"
            )
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch reports bad archives as RuntimeError, UnpicklingError, EOFError, ...
        raise ModelLoadError(
            f"cannot read model weights {path}: {exc}; run `make model` to rebuild them"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(
            f"model weights {path} are not a state_dict of tensors; run `make model` to rebuild them"
        )
    return state


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _expected_sha256(weights: Path) -> str | None:
    metadata = weights.parent / "metadata.json"
    if not metadata.is_file():
        return None
    try:
        digest = json.loads(metadata.read_text()).get("sha256")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read {metadata}: {exc}; run `make model` to rebuild it") from None
    return digest if isinstance(digest, str) else None


def resolve_device(device: str = "auto") -> tuple[str, str]:
    """The torch device to use and why: ("cuda", reason) when asked or available, else ("cpu", reason)."""
    if device not in DEVICES and not device.startswith("cuda:"):
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)} or cuda:N")
    available = torch.cuda.is_available()
    if device == "auto":
        if available:
            return "cuda", f"auto: CUDA is available ({torch.cuda.get_device_name(0)})"
        return "cpu", "auto: CUDA is not available"
    if device.startswith("cuda"):
        if not available:
            raise BackendUnavailable(f"device {device!r} requested but CUDA is not available on this machine")
        return device, f"{device} requested"
    return "cpu", "cpu requested"


def select_backend(
    kind: str = "auto",
    device: str = "auto",
    *,
    build: Callable[[], nn.Module],
    weights: str | os.PathLike[str],
    threads: int = 1,
    example_shape: tuple[int, ...] | None = None,
) -> ModelBackend:
    """Pick the backend and device for one network, log the choice and the reason, return it unloaded.

    This is the single-input standalone path: "auto" means PyTorch and "tensorrt" raises `BackendUnavailable`;
    repository models choose with `resolve_backend` and `select_runner`, which do run TensorRT.
    """
    if kind not in BACKEND_KINDS:
        raise ValueError(f"unknown backend {kind!r}; expected one of {', '.join(BACKEND_KINDS)}")
    # The standalone stage has no engine cache or ONNX export of its own: TensorRT runs through the model
    # repository (`services.model.repository`), which `python -m services.model` serves.
    if kind == "tensorrt":
        raise BackendUnavailable(
            "the TensorRT backend is not available in this build of the standalone stage; serve the model "
            "from the repository (python -m services.model) or use --backend torch (or auto)"
        )
    why_backend = "torch requested" if kind == "torch" else "auto: no TensorRT backend in this build"
    chosen_device, why_device = resolve_device(device)
    reason = f"backend torch: {why_backend}; device {chosen_device}: {why_device}"
    log.info("%s for %s", reason, weights)
    return TorchBackend(
        build, weights, device=chosen_device, threads=threads, example_shape=example_shape, reason=reason
    )


# ---- runners: what repository models run on ------------------------------------------------------------------

PRECISIONS = ("fp32", "fp16")
TORCH_MODES = ("eager", "script", "export")


@dataclass(frozen=True, slots=True)
class TorchOptions:
    """How the torch backend runs a module.

    `mode`: "eager", "script" (`torch.jit.trace`, then frozen) or "export" (`torch.export`, dynamic batch).
    `compile`: wrap in `torch.compile` (worth it on CUDA for larger networks; costs seconds at load).
    `cuda_graphs`: on CUDA, capture one graph per input shape (up to `max_graphs`) and replay it: fixed-shape
    traffic then pays one launch instead of one per kernel.
    """

    mode: str = "eager"
    compile: bool = False
    cuda_graphs: bool = False
    max_graphs: int = 16

    def __post_init__(self) -> None:
        if self.mode not in TORCH_MODES:
            raise ValueError(f"unknown torch mode {self.mode!r}; expected one of {', '.join(TORCH_MODES)}")


@runtime_checkable
class Runner(Protocol):
    """Runs one network on batches of named inputs. `load` before the first `run`; all three block."""

    #: Triton's backend name (`ModelConfig.backend`): "pytorch" or "tensorrt".
    name: str
    #: Triton's platform name: "pytorch_libtorch" or "tensorrt_plan".
    platform: str
    #: Where it runs: "cpu", "cuda:0", ...
    device: str
    #: "fp32" or "fp16".
    precision: str
    #: Why this backend and device were chosen.
    reason: str

    def load(self) -> None:
        """Build or read the network and warm up; `ModelLoadError` on failure."""
        ...

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch: every declared input in, every declared output out (float32 outputs on the host)."""
        ...

    def unload(self) -> None:
        """Release the network and its device memory."""
        ...


def tensorrt_status() -> tuple[bool, str]:
    """Whether TensorRT can run here, and why (or why not). Tests replace it to play other machines."""
    try:
        import tensorrt
    except ImportError:
        return False, "the tensorrt package is not installed (pip install 'pipeline-serving[gpu]')"
    except Exception as exc:  # a broken CUDA install raises OSError and friends at import
        return False, f"tensorrt does not import: {exc}"
    if not torch.cuda.is_available():
        return False, f"TensorRT {tensorrt.__version__} is installed but no CUDA GPU is visible"
    return True, f"TensorRT {tensorrt.__version__} and a CUDA GPU are present"


def resolve_backend(kind: str, device: str) -> tuple[str, str]:
    """The backend ("tensorrt" or "torch") for an instance on `device` ("cpu" or "cuda:N"), and why.

    Raises `BackendUnavailable` when TensorRT is asked for and cannot run, saying what is missing.
    """
    if kind not in BACKEND_KINDS:
        raise ValueError(f"unknown backend {kind!r}; expected one of {', '.join(BACKEND_KINDS)}")
    on_gpu = device.startswith("cuda")
    if kind == "torch":
        return "torch", "torch requested"
    if not on_gpu:
        if kind == "tensorrt":
            seen = "" if torch.cuda.is_available() else " (no CUDA GPU is visible here)"
            raise BackendUnavailable(
                f"backend tensorrt needs a GPU instance, but this instance is on {device}{seen}; "
                "use instance_group kind gpu, or backend torch/auto"
            )
        return "torch", "auto: the instance is on the CPU, where TensorRT cannot run"
    usable, why = tensorrt_status()
    if kind == "tensorrt":
        if not usable:
            raise BackendUnavailable(f"backend tensorrt requested, but {why}")
        return "tensorrt", f"tensorrt requested; {why}"
    if usable:
        return "tensorrt", f"auto: {why}"
    return "torch", f"auto: TensorRT is not usable ({why}), falling back to torch on {device}"


def select_runner(
    kind: str,
    device: str,
    *,
    network: Network,
    version_dir: Path | None,
    precision: str = "fp32",
    torch_options: TorchOptions | None = None,
    threads: int = 1,
    engine_cache: str | os.PathLike[str] | None = None,
    max_batch_size: int | None = None,
    preferred_batch_size: int | None = None,
    label: str = "",
) -> Runner:
    """The runner for one instance of a repository model, unloaded; logs the choice and the reason."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    backend, why = resolve_backend(kind, device)
    reason = f"backend {backend} on {device} at {precision}: {why}"
    log.info("%s: %s", label or network.architecture, reason)
    max_batch = max_batch_size or network.max_batch_size
    if backend == "tensorrt":
        from services.model.tensorrt import TensorRTRunner

        return TensorRTRunner(
            network,
            version_dir,
            device=device,
            precision=precision,
            cache_dir=engine_cache,
            max_batch_size=max_batch,
            preferred_batch_size=preferred_batch_size,
            reason=reason,
        )
    return TorchRunner(
        network,
        version_dir,
        device=device,
        precision=precision,
        options=torch_options or TorchOptions(),
        threads=threads,
        max_batch_size=max_batch,
        reason=reason,
    )


def to_device_inputs(
    network: Network, inputs: Mapping[str, np.ndarray], device: torch.device, float_dtype: torch.dtype
) -> list[torch.Tensor]:
    """The inputs as tensors on `device` in declared order; floating inputs in `float_dtype`."""
    tensors = []
    for spec in network.inputs:
        # No copy when the request already holds contiguous data of the right type, the usual case.
        tensor = torch.from_numpy(np.ascontiguousarray(inputs[spec.name]))
        if tensor.is_floating_point() and tensor.dtype != float_dtype:
            tensor = tensor.to(float_dtype)
        tensors.append(tensor.to(device) if device.type != "cpu" else tensor)
    return tensors


class TorchRunner:
    """A network in PyTorch under `torch.inference_mode`, on CUDA or the CPU, at FP32 or FP16.

    Args:
        network: what to build; `version_dir` is the folder its weights come from (None: built-in weights).
        device: "cpu" or "cuda:N".
        precision: "fp32", or "fp16" (the module and floating inputs in half; outputs come back as float32).
        options: eager / TorchScript / torch.export, torch.compile, CUDA graphs.
        threads: torch intra-op threads (process-wide; 1 unless measured otherwise).
        max_batch_size: the largest batch `torch.export` is told about.
        reason: why this backend was chosen, repeated in the log line of `load`.
    """

    name = "pytorch"
    platform = "pytorch_libtorch"

    def __init__(
        self,
        network: Network,
        version_dir: Path | None,
        *,
        device: str = "cpu",
        precision: str = "fp32",
        options: TorchOptions | None = None,
        threads: int = 1,
        max_batch_size: int | None = None,
        reason: str = "",
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
        self.network = network
        self.version_dir = version_dir
        self.device = device
        self.precision = precision
        self.options = options or TorchOptions()
        self.threads = threads
        self.max_batch_size = max_batch_size or network.max_batch_size
        self.reason = reason
        self._torch_device = torch.device(device)
        self._dtype = torch.float16 if precision == "fp16" else torch.float32
        self._module: Callable[..., torch.Tensor] | None = None
        self._graphs: dict[tuple[tuple[int, ...], ...], tuple[Any, list[torch.Tensor], torch.Tensor]] = {}

    def load(self) -> None:
        """Build the module with its weights, convert it as the options say, and run one warm-up batch."""
        if self._torch_device.type == "cpu":
            torch.set_num_threads(self.threads)
        module = self.network.build(self.version_dir).to(self._torch_device, self._dtype).eval()
        example = to_device_inputs(self.network, self.network.example(2), self._torch_device, self._dtype)
        with torch.inference_mode(False), torch.no_grad():
            if self.options.mode == "script":
                traced = torch.jit.trace(module, tuple(example), strict=False, check_trace=False)
                module = torch.jit.freeze(traced.eval())
            elif self.options.mode == "export":
                module = self._export(module, example)
        if self.options.compile:
            module = torch.compile(module, dynamic=True)
        self._module = module
        self.run(self.network.example(1))
        log.info(
            "loaded %s (%s) with torch %s on %s at %s, mode %s%s%s (%s)",
            self.network.architecture,
            self.version_dir or "built-in weights",
            torch.__version__,
            self.device,
            self.precision,
            self.options.mode,
            ", torch.compile" if self.options.compile else "",
            ", CUDA graphs" if self._use_graphs else "",
            self.reason or "as configured",
        )

    def _export(self, module: nn.Module, example: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
        from services.model.networks import export_dynamic_shapes

        shapes = export_dynamic_shapes(self.network, self.max_batch_size)
        try:
            program = torch.export.export(module, tuple(example), dynamic_shapes=tuple(shapes))
        except Exception as exc:  # export reports unsupported code in many exception types
            raise ModelLoadError(f"torch.export of {self.network.architecture} failed: {exc}") from None
        return program.module()

    @property
    def _use_graphs(self) -> bool:
        return self.options.cuda_graphs and self._torch_device.type == "cuda" and not self.options.compile

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One batch; on the CPU at FP32 the input tensors share memory with the request's arrays."""
        module = self._module
        if module is None:
            raise RuntimeError("TorchRunner.run called before load()")
        with torch.inference_mode():
            tensors = to_device_inputs(self.network, inputs, self._torch_device, self._dtype)
            out = self._replay(module, tensors) if self._use_graphs else module(*tensors)
            if out.dtype != torch.float32:
                out = out.float()
            array = out.cpu().numpy() if out.device.type != "cpu" else out.numpy()
        return {self.network.outputs[0].name: array}

    def _replay(self, module: Callable[..., torch.Tensor], tensors: list[torch.Tensor]) -> torch.Tensor:
        """Run through a CUDA graph captured for these shapes (captured on first sight, up to `max_graphs`)."""
        key = tuple(tuple(t.shape) for t in tensors)
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= self.options.max_graphs:
                return module(*tensors)  # too many shapes: graphs would only pin memory
            static = [t.clone() for t in tensors]
            # Capture needs the kernels warmed (cuDNN picks algorithms) on a side stream first.
            side = torch.cuda.Stream(self._torch_device)
            side.wait_stream(torch.cuda.current_stream(self._torch_device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    module(*static)
            torch.cuda.current_stream(self._torch_device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                output = module(*static)
            entry = (graph, static, output)
            self._graphs[key] = entry
        graph, static, output = entry
        for target, source in zip(static, tensors, strict=True):
            target.copy_(source)
        graph.replay()
        return output.clone()

    def unload(self) -> None:
        """Drop the module and its graphs; on CUDA also return the cached memory."""
        self._module = None
        self._graphs.clear()
        if self._torch_device.type == "cuda":
            torch.cuda.empty_cache()

"""Backends that run a network on numpy batches: PyTorch now (CUDA, else CPU), TensorRT later.

A stage wraps one `ModelBackend` and does not care which: `select_backend` picks it from the settings
(`--backend auto|torch|tensorrt`, `--device auto|cpu|cuda`) and logs what it chose and why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

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

    `kind="auto"` prefers TensorRT where it exists and falls back to PyTorch; this build has no TensorRT
    backend yet, so "auto" means PyTorch and "tensorrt" raises `BackendUnavailable`.
    """
    if kind not in BACKEND_KINDS:
        raise ValueError(f"unknown backend {kind!r}; expected one of {', '.join(BACKEND_KINDS)}")
    if kind == "tensorrt":
        raise BackendUnavailable(
            "the TensorRT backend is not available in this build yet; use --backend torch (or auto)"
        )
    why_backend = "torch requested" if kind == "torch" else "auto: no TensorRT backend in this build"
    chosen_device, why_device = resolve_device(device)
    reason = f"backend torch: {why_backend}; device {chosen_device}: {why_device}"
    log.info("%s for %s", reason, weights)
    return TorchBackend(
        build, weights, device=chosen_device, threads=threads, example_shape=example_shape, reason=reason
    )

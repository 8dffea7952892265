"""Instances that run a model file: ONNX Runtime, and PyTorch (TorchScript and `torch.export` programs).

Both share `ArtifactInstance`: inputs come in under their config names and are reshaped to what the model
takes (`reshape`), outputs go back under their config names and shapes, and `load` ends with a warm-up batch
whose outputs are checked against the config (datatype and dims), which is how a TorchScript model's config,
which its file cannot confirm, gets checked. TensorRT's instance lives in `services.model.tensorrt`.
"""

from __future__ import annotations

import abc
import logging
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.protocol.datatypes import DATATYPES, datatype_of
from pipeline.protocol.errors import InvalidInput, RepositoryError
from pipeline.stage.api import NO_DEADLINE, Deadline
from services.model.artifacts import (
    ONNX,
    TORCH_EXPORT,
    TORCHSCRIPT,
    Binding,
    Bindings,
    Signature,
    export_onnx,
    first_line,
    load_program,
    load_torchscript,
)

log = logging.getLogger(__name__)

# Request tensors arrive as read-only views of the request bytes; torch warns when it wraps one because it
# cannot mark a tensor read-only. Nothing here writes to its input, so the copy the warning suggests is waste.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


class ArtifactInstance(abc.ABC):
    """One instance of a model file; subclasses implement `_load`, `_run` and `unload`.

    Args:
        artifact: the model file.
        bindings: the config's tensors bound to the model's (`services.model.artifacts.reconcile`).
        datatypes: each config tensor's protocol datatype, by name.
        batching: whether shapes carry a batch dimension first (max_batch_size > 0).
        device: "cpu" or "cuda:N".
        reason: why this runner and device were chosen.
    """

    inline = False
    #: A model file's batch is compute alone: a lone instance runs brief ones on the event loop.
    inline_when_brief = True

    def __init__(
        self,
        artifact: Path,
        bindings: Bindings,
        datatypes: Mapping[str, str],
        *,
        batching: bool,
        device: str,
        reason: str,
    ) -> None:
        self.artifact = artifact
        self.bindings = bindings
        self.datatypes = dict(datatypes)
        self.batching = batching
        self.device = device
        self.reason = reason

    def load(self) -> None:
        """Read the model, then run one warm-up batch and check its outputs against the config."""
        self._load()
        if any(self.datatypes[b.name] == "BYTES" for b in self.bindings.inputs):
            return  # no meaningful zeros for strings; the first request checks
        example = {
            b.name: np.zeros(
                tuple(1 if d < 0 else d for d in b.client_shape), dtype=DATATYPES[self.datatypes[b.name]]
            )
            for b in self.bindings.inputs
        }
        try:
            outputs = self.run(example)
        except RepositoryError:
            raise
        except Exception as exc:  # the model refused inputs shaped as the config says
            raise RepositoryError(
                f"{self.artifact}: a warm-up batch shaped as the config declares fails: {first_line(exc)}"
            ) from None
        for binding in self.bindings.outputs:
            array = outputs[binding.name]
            expected = self.datatypes[binding.name]
            if datatype_of(array) != expected:
                raise RepositoryError(
                    f"{self.artifact}: output '{binding.name}' comes out as {datatype_of(array)}, the config "
                    f"declares {expected}"
                )
            shape = binding.client_shape
            if array.ndim != len(shape) or any(
                d not in (-1, s) for d, s in zip(shape, array.shape, strict=False)
            ):
                raise RepositoryError(
                    f"{self.artifact}: output '{binding.name}' comes out with shape {list(array.shape)}, the "
                    f"config declares {list(shape)}"
                )

    def run(
        self, inputs: Mapping[str, np.ndarray], deadline: Deadline = NO_DEADLINE
    ) -> dict[str, np.ndarray]:
        """One batch under the config's names and shapes (one call of the runtime: the deadline, which the
        stage runtime checked before it started, cannot stop it half way)."""
        feeds = {}
        for binding in self.bindings.inputs:
            array = inputs.get(binding.name)
            if array is None:
                continue  # an optional input the request leaves out
            feeds[binding] = self._to_model(array, binding)
        produced = self._run(feeds)
        return {b.name: self._to_client(produced[b.name], b) for b in self.bindings.outputs}

    def _to_model(self, array: np.ndarray, binding: Binding) -> np.ndarray:
        if binding.model_shape == binding.client_shape:
            return array
        lead = array.shape[:1] if self.batching else ()
        return array.reshape((*lead, *binding.model_shape[len(lead) :]))

    def _to_client(self, array: np.ndarray, binding: Binding) -> np.ndarray:
        if binding.model_shape == binding.client_shape:
            return array
        lead = array.shape[:1] if self.batching else ()
        return array.reshape((*lead, *binding.client_shape[len(lead) :]))

    @abc.abstractmethod
    def _load(self) -> None:
        """Open the model file and make it ready to run."""

    @abc.abstractmethod
    def _run(self, feeds: Mapping[Binding, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs under the config's names, from its inputs bound to the config's."""

    @abc.abstractmethod
    def unload(self) -> None:
        """Release what `load` acquired."""


class OnnxRuntimeInstance(ArtifactInstance):
    """An ONNX file in an ONNX Runtime session: the CPU provider, or CUDA's on a GPU. A PyTorch file (`kind`
    TorchScript or `torch.export`) runs as its ONNX export, made when it loads (`runner: onnxruntime`).

    Args:
        threads: intra-op threads of the session (1 unless measured otherwise, as for torch); inter-op
            parallelism is off (sequential execution), as the service runs one batch per instance at a time.
    """

    def __init__(self, *args: Any, threads: int = 1, kind: str = ONNX, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.threads = threads
        self.kind = kind
        self._session: Any = None
        self._output_names: list[str] = []

    def _load(self) -> None:
        import onnxruntime as ort

        # No telemetry: the service reaches nothing but its clients and the repository.
        ort.disable_telemetry_events()
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.device.startswith("cuda"):
            index = int(self.device.partition(":")[2] or 0)
            providers: list[Any] = [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        with tempfile.TemporaryDirectory(prefix="pipeline-onnx-") as tmp:
            path = self.artifact if self.kind == ONNX else self._exported(Path(tmp) / "model.onnx")
            try:
                self._session = ort.InferenceSession(str(path), options, providers=providers)
            except Exception as exc:  # ONNX Runtime raises its own Fail/InvalidGraph/NotImplemented types
                raise RepositoryError(
                    f"{self.artifact}: ONNX Runtime cannot load it: {first_line(exc)}"
                ) from None
        self._output_names = [b.model_name or b.name for b in self.bindings.outputs]
        log.info(
            "loaded %s with ONNX Runtime %s on %s (%s), %d intra-op thread%s",
            self.artifact,
            ort.__version__,
            self.device,
            self.reason,
            self.threads,
            "" if self.threads == 1 else "s",
        )

    def _exported(self, path: Path) -> Path:
        """A PyTorch file's ONNX export (`services.model.artifacts.export_onnx`)."""
        try:
            return export_onnx(
                self.artifact,
                self.kind,
                list(self.bindings.inputs),
                list(self.bindings.outputs),
                path,
                batching=self.batching,
            )
        except Exception as exc:  # torch.onnx raises its own UnsupportedOperatorError and friends
            raise RepositoryError(f"{self.artifact}: cannot export it to ONNX: {first_line(exc)}") from None

    def _run(self, feeds: Mapping[Binding, np.ndarray]) -> dict[str, np.ndarray]:
        session = self._session
        if session is None:
            raise RuntimeError("OnnxRuntimeInstance.run called before load()")
        results = session.run(self._output_names, {b.model_name: a for b, a in feeds.items()})
        return {b.name: r for b, r in zip(self.bindings.outputs, results, strict=True)}

    def unload(self) -> None:
        self._session = None


class TorchInstance(ArtifactInstance):
    """A TorchScript module or a `torch.export` program in PyTorch, under `torch.inference_mode`.

    Args:
        kind: `TORCHSCRIPT` or `TORCH_EXPORT`.
        signature: the model file's signature (arguments by keyword or position, dimension ranges).
        threads: torch intra-op threads (process-wide; 1 unless measured otherwise).
        fp16: on CUDA, run under autocast to FP16 (outputs come back in the config's datatypes).
        compile: wrap the module in `torch.compile` (costs seconds at load; pays on CUDA for larger models).
    """

    def __init__(
        self,
        *args: Any,
        kind: str,
        signature: Signature,
        threads: int = 1,
        fp16: bool = False,
        compile: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if kind not in (TORCHSCRIPT, TORCH_EXPORT):
            raise ValueError(f"not a PyTorch model kind: {kind}")
        self.kind = kind
        self.signature = signature
        self.threads = threads
        self.fp16 = fp16 and device_is_cuda(self.device)
        self.compile = compile
        self._module: Any = None
        self._by_keyword = kind == TORCHSCRIPT or signature.by_keyword
        self._keyword_names = all(b.model_name for b in self.bindings.inputs)
        self._order = sorted(self.bindings.inputs, key=lambda b: b.index)

    def _load(self) -> None:
        import torch

        if self.device == "cpu":
            torch.set_num_threads(self.threads)
        if self.kind == TORCHSCRIPT:
            module = load_torchscript(self.artifact, self.device)
        else:
            program = load_program(self.artifact)
            if self.device != "cpu":
                from torch.export.passes import move_to_device_pass

                program = move_to_device_pass(program, self.device)
            module = program.module()
        if self.compile:
            module = torch.compile(module, dynamic=True)
        self._module = module
        log.info(
            "loaded %s (%s) with torch %s on %s%s (%s), %d intra-op thread%s",
            self.artifact,
            "TorchScript" if self.kind == TORCHSCRIPT else "torch.export",
            torch.__version__,
            self.device,
            ", FP16 autocast" if self.fp16 else "",
            self.reason,
            self.threads,
            "" if self.threads == 1 else "s",
        )

    def _check_ranges(self, feeds: Mapping[Binding, np.ndarray]) -> None:
        """Refuse dimensions outside what the program was exported for, or that differ where it ties them
        together, naming the input, before torch's own guard fails deep inside."""
        seen: dict[str, tuple[str, int]] = {}
        for binding, array in feeds.items():
            for axis, symbol in self.signature.ties.get(binding.model_name, {}).items():
                if axis >= array.ndim:
                    continue
                first = seen.setdefault(symbol, (binding.name, array.shape[axis]))
                if first[1] != array.shape[axis]:
                    raise InvalidInput(
                        f"{binding.name}: dimension {axis} is {array.shape[axis]}, {first[0]}'s is {first[1]}; "
                        "the model takes them equal"
                    )
            for axis, (low, high) in self.signature.ranges.get(binding.model_name, {}).items():
                size = array.shape[axis] if axis < array.ndim else None
                if size is not None and (size < low or (high and size > high)):
                    what = "batch size" if axis == 0 else f"dimension {axis}"
                    raise InvalidInput(
                        f"{binding.name}: {what} is {size}, the model takes {low}..{high or 'any'}"
                    )

    def _run(self, feeds: Mapping[Binding, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        module = self._module
        if module is None:
            raise RuntimeError("TorchInstance.run called before load()")
        if self.kind == TORCH_EXPORT:
            self._check_ranges(feeds)
        with torch.inference_mode():
            tensors = {b: self._tensor(a) for b, a in feeds.items()}
            try:
                with torch.autocast("cuda", dtype=torch.float16, enabled=self.fp16):
                    if self._by_keyword and self._keyword_names:
                        result = module(**{b.model_name: t for b, t in tensors.items()})
                    else:
                        result = module(*(tensors[b] for b in self._order if b in tensors))
            except IndexError as exc:
                # An index the model looks up that is out of its range (a token id past the vocabulary):
                # the request's content, not the server, is at fault.
                raise InvalidInput(f"the model cannot take these inputs: {first_line(exc)}") from None
            return {b.name: self._output(result, b) for b in self.bindings.outputs}

    def _tensor(self, array: np.ndarray):
        import torch

        # No copy when the request already holds contiguous data, the usual case.
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.to(self.device) if self.device != "cpu" else tensor

    def _output(self, result: Any, binding: Binding) -> np.ndarray:
        import torch

        if isinstance(result, Mapping):
            if binding.model_name in result:
                value = result[binding.model_name]
            elif binding.name in result:
                value = result[binding.name]
            else:
                value = list(result.values())[binding.index]
        elif isinstance(result, (tuple, list)):
            value = result[binding.index]
        elif binding.index == 0:
            value = result
        else:
            raise RepositoryError(
                f"{self.artifact}: returns one tensor, but the config reads output #{binding.index}"
            )
        if not isinstance(value, torch.Tensor):
            raise RepositoryError(
                f"{self.artifact}: output '{binding.name}' is a {type(value).__name__}, not a tensor"
            )
        expected = self.datatypes[binding.name]
        if value.is_floating_point() and expected in ("FP32", "FP64", "FP16") and self.fp16:
            value = value.to({"FP32": torch.float32, "FP64": torch.float64, "FP16": torch.float16}[expected])
        value = value.detach()
        return value.cpu().numpy() if value.device.type != "cpu" else value.numpy()

    def unload(self) -> None:
        self._module = None
        if device_is_cuda(self.device):
            import torch

            torch.cuda.empty_cache()


def device_is_cuda(device: str) -> bool:
    """Whether a device string names a GPU."""
    return device.startswith("cuda")

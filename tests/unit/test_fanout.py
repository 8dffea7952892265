"""A fan-out step's tensors split along their first dimension and gathered back, for every datatype."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.protocol.codec import Tensor
from pipeline.protocol.errors import InvalidInput, StageError
from pipeline.protocol.types import TensorSpec
from pipeline.router.execution.fanout import gather, split


def test_elements_split_and_gather_back_in_order() -> None:
    numbers = Tensor.from_array("X", np.arange(12, dtype=np.float32).reshape(3, 2, 2))
    parts = split(numbers, "step 1")
    assert [p.shape for p in parts] == [(1, 2, 2)] * 3
    np.testing.assert_array_equal(parts[2].to_array(), numbers.to_array()[2:3])
    assert gather("X", parts, None, "step 1") == numbers

    words = np.array([b"a", b"bcd", b""], dtype=object)
    text = Tensor.from_array("W", words)
    back = gather("W", split(text, "step 1"), None, "step 1")
    assert back.shape == (3,) and back.to_array().tolist() == [b"a", b"bcd", b""]


def test_no_elements_gather_into_an_empty_tensor_shaped_as_the_model_says() -> None:
    empty = gather("Y", [], TensorSpec("Y", "FP32", (-1, 10)), "step 1")
    assert empty.shape == (0, 10) and empty.raw == b"" and empty.to_array().shape == (0, 10)
    assert gather("Y", [], TensorSpec("Y", "INT64", (-1, -1)), "step 1").shape == (0, 0)


def test_elements_whose_outputs_disagree_and_scalars_are_refused() -> None:
    a = Tensor.from_array("Y", np.zeros((1, 2), np.float32))
    b = Tensor.from_array("Y", np.zeros((1, 3), np.float32))
    with pytest.raises(StageError, match="element 1's output 'Y'"):
        gather("Y", [a, b], None, "step 1")
    with pytest.raises(InvalidInput, match="is a scalar"):
        split(Tensor.from_array("X", np.float32(1.0).reshape(())), "step 1")

"""`digits_postprocess`: argmax labels and a softmax that stays finite for any finite logits."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pipeline.protocol.errors import InvalidInput
from tests.stages import example_stage

#: The example repository's `digits_postprocess`, loaded through the python backend.
CLASSIFY = example_stage("digits_postprocess")
softmax = sys.modules[type(CLASSIFY).__module__].softmax


def test_labels_and_scores_match_a_float64_reference() -> None:
    logits = np.random.default_rng(0).normal(scale=5.0, size=(64, 10)).astype(np.float32)
    out = CLASSIFY.infer({"LOGITS": logits})

    assert out["LABEL"].dtype == np.int64 and out["LABEL"].shape == (64, 1)
    assert out["SCORES"].dtype == np.float32 and out["SCORES"].shape == (64, 10)
    np.testing.assert_array_equal(out["LABEL"][:, 0], logits.argmax(axis=1))
    reference = np.exp(logits.astype(np.float64))
    reference /= reference.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out["SCORES"], reference, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out["SCORES"].sum(axis=1), 1.0, atol=1e-5)


def test_huge_logits_do_not_overflow() -> None:
    logits = np.array([[1000.0, -1000.0, 999.0] + [0.0] * 7, [-3e38] * 9 + [3e38]], dtype=np.float32)
    scores = softmax(logits)
    assert np.isfinite(scores).all()
    np.testing.assert_allclose(
        scores[0, :3], [1 / (1 + np.exp(-1.0)), 0.0, np.exp(-1.0) / (1 + np.exp(-1.0))]
    )
    np.testing.assert_allclose(scores[1], [0.0] * 9 + [1.0])


def test_input_is_not_modified() -> None:
    logits = np.arange(20, dtype=np.float32).reshape(2, 10)
    logits.flags.writeable = False  # the runtime hands over read-only views of the request bytes
    CLASSIFY.infer({"LOGITS": logits})
    np.testing.assert_array_equal(logits, np.arange(20, dtype=np.float32).reshape(2, 10))


@given(
    arrays(np.float32, st.tuples(st.integers(1, 16), st.just(10)), elements=st.floats(-1e4, 1e4, width=32))
)
def test_rows_are_distributions_and_agree_with_argmax(logits: np.ndarray) -> None:
    out = CLASSIFY.infer({"LOGITS": logits})
    scores, labels = out["SCORES"], out["LABEL"][:, 0]
    assert np.all(scores >= 0.0) and np.all(scores <= 1.0)
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(labels, logits.argmax(axis=1))
    assert np.all(scores[np.arange(len(labels)), labels] == scores.max(axis=1))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_are_refused_naming_the_row(bad: float) -> None:
    logits = np.zeros((4, 10), dtype=np.float32)
    logits[2, 5] = bad
    with pytest.raises(InvalidInput, match=r"^LOGITS\[2\]: logits must be finite"):
        CLASSIFY.infer({"LOGITS": logits})


def test_declaration() -> None:
    stage = CLASSIFY
    assert stage.name == "digits_postprocess"
    assert stage.max_batch_size == 256
    assert [(t.name, t.datatype, t.shape) for t in stage.inputs] == [("LOGITS", "FP32", (-1, 10))]
    assert [(t.name, t.datatype, t.shape) for t in stage.outputs] == [
        ("LABEL", "INT64", (-1, 1)),
        ("SCORES", "FP32", (-1, 10)),
    ]

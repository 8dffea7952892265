"""A TorchServe handler split into three models (`--split-handlers`): the folders written for it, and what its
methods hand each other, cut per request and put back together for batches the router forms anew."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.protocol.errors import ConfigError
from pipeline.runtime.torchserve_store import archive_models, read_model, remove_model, write_model
from pipeline.stage.torchserve.handler_values import merge_rows, split_rows
from pipeline.tools.model_store import LauncherModelStore, write_store_models
from tests.torchserve.archive import archive_with_zipfile


def test_a_batchs_value_cut_per_request_comes_back_for_any_batch_of_them() -> None:
    value = (
        torch.arange(12, dtype=torch.float32).reshape(3, 2, 2),
        np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int64),
        ["one", b"\x00two", {"three": [3, None, bytearray(b"3")], "t": torch.tensor([3.5])}],
        {"ids": torch.tensor([7, 8, 9])},
    )
    rows = split_rows(value, 3, "preprocess")
    assert all(isinstance(row, bytes) for row in rows)
    # Another batch: the third request and the first, in that order.
    tensor, array, items, mapping = merge_rows([rows[2], rows[0]])
    assert isinstance(tensor, torch.Tensor) and torch.equal(tensor, value[0][[2, 0]])
    assert isinstance(array, np.ndarray) and np.array_equal(array, value[1][[2, 0]])
    assert items[1] == "one"
    third = items[0]
    assert third["three"][:2] == [3, None] and third["three"][2] == bytearray(b"3")
    assert isinstance(third["three"][2], bytearray) and torch.equal(third["t"], torch.tensor([3.5]))
    assert torch.equal(mapping["ids"], torch.tensor([9, 7]))
    assert merge_rows([rows[1]])[2] == [b"\x00two"]


def test_scalar_rows_stack_back_into_a_vector() -> None:
    counts = torch.tensor([1.0, 2.0, 3.0])
    rows = split_rows(counts, 3, "inference")
    assert torch.equal(merge_rows(rows), counts)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.zeros(2, 3), "shape [2, 3] for 3 requests"),
        (["a", "b"], "a list of 2 items for 3 requests"),
        ("text", "returned a str"),
        (torch.zeros(3, dtype=torch.bfloat16), "bfloat16"),
        ([object(), 1, 2], "an item holding a object"),
        (np.array([1, "a", None], dtype=object), "array of objects"),
    ],
)
def test_a_value_the_split_form_cannot_carry_is_named(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        split_rows(value, 3, "preprocess")


def test_rows_of_different_shapes_do_not_make_a_batch() -> None:
    first = split_rows(torch.zeros(1, 2), 1, "preprocess")
    second = split_rows(torch.zeros(1, 3), 1, "preprocess")
    with pytest.raises(ValueError, match="different shapes"):
        merge_rows([*first, *second])


def _write(store: Path, repository: Path, split: str | None) -> None:
    write_store_models(
        LauncherModelStore(model_store=store, models="words.mar", split_handlers=split), repository
    )


def test_a_split_archive_is_an_ensemble_of_its_three_methods(tmp_path: Path) -> None:
    store, repository = tmp_path / "store", tmp_path / "repository"
    archive_with_zipfile(store)
    _write(store, repository, "words")
    assert sorted(path.name for path in repository.iterdir()) == [
        "words",
        "words_inference",
        "words_postprocess",
        "words_preprocess",
    ]
    assert 'platform: "ensemble"' in (repository / "words" / "config.pbtxt").read_text()
    model = read_model(repository, "words")
    assert model is not None and model.split
    assert [m.name for m in archive_models(repository)] == ["words"]  # the methods' models are no archives
    # Written again as one stage: the methods' folders go.
    _write(store, repository, None)
    assert sorted(path.name for path in repository.iterdir()) == ["words"]
    model = read_model(repository, "words")
    assert model is not None and not model.split
    # Split again, then removed: every folder goes.
    write_model(repository, replace(model, split=True))
    assert len(list(repository.iterdir())) == 4
    remove_model(repository, "words")
    assert list(repository.iterdir()) == []


def test_split_handlers_that_name_a_model_not_loaded_are_refused(tmp_path: Path) -> None:
    store, repository = tmp_path / "store", tmp_path / "repository"
    archive_with_zipfile(store)
    with pytest.raises(ConfigError, match="--split-handlers names nope, which --models does not load"):
        _write(store, repository, "nope")
    assert not repository.exists() or list(repository.iterdir()) == []

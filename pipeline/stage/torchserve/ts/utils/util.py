"""TorchServe's helpers that handlers use: their error with a status, label maps, finding a module's classes."""

from __future__ import annotations

import inspect
import json
import os
import types
from typing import Any


class PredictionException(Exception):
    """Raised by a handler to answer its whole batch with `error_code` and `message` (TorchServe's way to
    fail a batch with a status of the handler's choosing)."""

    def __init__(self, message: str, error_code: int = 500) -> None:
        self.message = message
        self.error_code = error_code
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message} : {self.error_code}"


def list_classes_from_module(module: types.ModuleType, parent_class: type | None = None) -> list[type]:
    """The classes a module defines (not those it imports), those subclassing `parent_class` if given."""
    classes = [
        member
        for _, member in inspect.getmembers(module, inspect.isclass)
        if member.__module__ == module.__name__
    ]
    return [c for c in classes if issubclass(c, parent_class)] if parent_class is not None else classes


def load_label_mapping(mapping_file_path: str) -> dict[str, Any] | None:
    """The archive's `index_to_name.json` (index -> label, or index -> [id, label]); None where there is
    no such file."""
    if not os.path.isfile(mapping_file_path):
        return None
    with open(mapping_file_path) as f:
        mapping = json.load(f)
    if not isinstance(mapping, dict):
        raise TypeError(f"mapping file {mapping_file_path} is not a JSON object (index -> label)")
    first = next(iter(mapping.values()), None)
    if isinstance(first, list):
        mapping = {key: value[-1] for key, value in mapping.items()}
    return mapping


def map_class_to_label(
    probs: list[list[float]],
    mapping: dict[str, Any] | None = None,
    lbl_classes: list[list[Any]] | None = None,
) -> list[dict[str, float]]:
    """Each row's class probabilities as {label: probability}, labels from `mapping` where given."""
    if lbl_classes is None:
        lbl_classes = [list(range(len(row))) for row in probs]
    return [
        {
            (mapping[str(label)] if mapping is not None else str(label)): prob
            for label, prob in zip(labels, row, strict=False)
        }
        for labels, row in zip(lbl_classes, probs, strict=False)
    ]

"""What a split handler's methods hand each other (`pipeline.stage.torchserve.handler_parts`), cut into one
BYTES element per request and put back together for the next method's batch.

The router batches each of the three models apart, so the batch `inference` gets is not the one `preprocess`
made: each method's result travels per request. A result is cut by its shape, which says which part is whose:

- a torch tensor or a numpy array: one row (along dimension 0) per request, rows stacked back into one;
- a list: one item per request;
- a tuple or a dict (string keys): each member cut by these rules, and put back into a tuple or dict.

An item of a list may be any value made of strings, numbers, booleans, None, bytes, tensors, arrays, lists,
tuples and dicts with string keys. Tensors travel as numpy arrays (their dtype, shape and raw bytes) and come
back as torch tensors on the CPU; nothing is pickled, so an element sent by a client to one of the models
can do no more than any other malformed input. Anything else raises `ValueError` naming what was found.

An element is `torchserve_store.pack`'s layout: a JSON tree of the value, with the raw bytes of its arrays
and byte strings as its parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline.runtime.torchserve_store import pack, unpack

Tree = dict[str, Any]


def split_rows(value: Any, count: int, what: str) -> list[bytes]:
    """`value` (a method's result for a batch of `count` requests) cut into one element per request; `what`
    names the method in errors."""
    rows: list[list[bytes]] = [[] for _ in range(count)]
    trees = _split(value, count, rows, what)
    return [pack({"value": tree}, parts) for tree, parts in zip(trees, rows, strict=True)]


def merge_rows(rows: Sequence[bytes]) -> Any:
    """The value of a batch put back together from its requests' elements (`split_rows`'s inverse)."""
    unpacked = [unpack(row) for row in rows]
    return _merge([meta["value"] for meta, _ in unpacked], [parts for _, parts in unpacked])


def _split(value: Any, count: int, rows: list[list[bytes]], what: str) -> list[Tree]:
    if isinstance(value, torch.Tensor | np.ndarray):
        array = _array(value, what)
        if array.ndim == 0 or array.shape[0] != count:
            raise ValueError(
                f"{what} returned a tensor of shape {list(array.shape)} for {count} requests: the split form "
                "needs one row per request"
            )
        torch_made = isinstance(value, torch.Tensor)
        return [{"rows": _array_tree(array[i], rows[i], torch_made)} for i in range(count)]
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(
                f"{what} returned a list of {len(value)} items for {count} requests: the split form needs one "
                "item per request"
            )
        return [{"item": _leaf(item, rows[i], what)} for i, item in enumerate(value)]
    if isinstance(value, tuple):
        members = [_split(member, count, rows, what) for member in value]
        return [{"tuple": [member[i] for member in members]} for i in range(count)]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        split = {key: _split(member, count, rows, what) for key, member in value.items()}
        return [{"dict": {key: member[i] for key, member in split.items()}} for i in range(count)]
    raise ValueError(
        f"{what} returned a {type(value).__name__}: the split form carries tensors and arrays (a row per "
        "request), lists (an item per request), and tuples or dicts of them"
    )


def _merge(trees: list[Tree], parts: list[list[bytes]]) -> Any:
    kinds = {next(iter(tree)) for tree in trees}
    if len(kinds) != 1:
        raise ValueError(f"the requests of a batch carry values of different kinds: {sorted(kinds)}")
    (kind,) = kinds
    if kind == "rows":
        arrays = [_array_of(tree["rows"], row, copy=False) for tree, row in zip(trees, parts, strict=True)]
        if len({array.shape for array in arrays}) != 1 or len({array.dtype for array in arrays}) != 1:
            raise ValueError("the requests of a batch carry rows of different shapes or dtypes")
        stacked = np.stack(arrays)
        return torch.from_numpy(stacked) if trees[0]["rows"]["torch"] else stacked
    if kind == "item":
        return [_value(tree["item"], row) for tree, row in zip(trees, parts, strict=True)]
    if kind == "tuple":
        return tuple(
            _merge([tree["tuple"][i] for tree in trees], parts) for i in range(len(trees[0]["tuple"]))
        )
    if kind == "dict":
        return {key: _merge([tree["dict"][key] for tree in trees], parts) for key in trees[0]["dict"]}
    raise ValueError(f"not a split handler's value: {kind!r}")


def _leaf(value: Any, parts: list[bytes], what: str) -> Tree:
    """One request's item, whole."""
    if value is None or isinstance(value, bool | int | float | str):
        return {"json": value}
    if isinstance(value, bytes | bytearray):
        parts.append(bytes(value))
        return {"bytes": len(parts) - 1, "mutable": isinstance(value, bytearray)}
    if isinstance(value, torch.Tensor | np.ndarray):
        return {"array": _array_tree(_array(value, what), parts, isinstance(value, torch.Tensor))}
    if isinstance(value, list | tuple):
        return {"list" if isinstance(value, list) else "tuple": [_leaf(item, parts, what) for item in value]}
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"dict": {key: _leaf(item, parts, what) for key, item in value.items()}}
    raise ValueError(
        f"{what} returned an item holding a {type(value).__name__}, which the split form cannot carry"
    )


def _value(tree: Tree, parts: list[bytes]) -> Any:
    """`_leaf`'s inverse."""
    kind, body = next(iter(tree.items()))
    if kind == "json":
        return body
    if kind == "bytes":
        data = parts[body]
        return bytearray(data) if tree["mutable"] else data
    if kind == "array":
        array = _array_of(body, parts)
        return torch.from_numpy(array) if body["torch"] else array
    if kind in ("list", "tuple"):
        items = [_value(item, parts) for item in body]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {key: _value(item, parts) for key, item in body.items()}
    raise ValueError(f"not a split handler's item: {kind!r}")


def _array(value: torch.Tensor | np.ndarray, what: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise ValueError(f"{what} returned a numpy array of objects, which the split form cannot carry")
        return value
    if value.dtype == torch.bfloat16:
        raise ValueError(f"{what} returned a bfloat16 tensor, which numpy cannot hold: convert it to float32")
    return value.detach().cpu().numpy()


def _array_tree(array: np.ndarray, parts: list[bytes], torch_made: bool) -> Tree:
    parts.append(np.ascontiguousarray(array).tobytes())
    return {"dtype": array.dtype.str, "shape": list(array.shape), "part": len(parts) - 1, "torch": torch_made}


def _array_of(tree: Tree, parts: list[bytes], *, copy: bool = True) -> np.ndarray:
    """The array over its part's bytes; a copy unless the caller copies it (torch wants a writable array, and
    the handler may write into what it is given)."""
    array = np.frombuffer(parts[tree["part"]], dtype=np.dtype(tree["dtype"])).reshape(tree["shape"])
    return array.copy() if copy else array

"""Fuzzing the ensemble loader: random YAML documents, mutations of a valid one, and random bytes.

Every case loads or fails with `ConfigError` naming the file; nothing else may escape, nothing may hang.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.ensemble.catalog import load_ensemble
from pipeline.ensemble.plan import EnsemblePlan
from pipeline.protocol.errors import ConfigError

EXAMPLES = int(os.environ.get("PIPELINE_FUZZ_EXAMPLES", "200"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

VALID: dict[str, Any] = {
    "name": "fuzzed",
    "max_batch_size": 8,
    "stages": {
        "a": {"address": "${A_ADDRESS:-127.0.0.1:8101}", "dynamic_batching": {"max_batch_size": 8}},
        "b": {"address": "127.0.0.1:8102", "max_inflight_requests": 2},
    },
    "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 4]}],
    "steps": [
        {"model_name": "m1", "stage": "a", "input_map": {"X": "X"}, "output_map": {"Y": "mid"}},
        {"model_name": "m2", "stage": "b", "input_map": {"X": "mid"}, "output_map": {"Y": "Y"}},
    ],
}

WORDS = [
    "name", "max_batch_size", "stages", "inputs", "outputs", "steps", "address", "dynamic_batching",
    "model_name", "model_version", "stage", "input_map", "output_map", "datatype", "shape", "X", "Y", "a",
    "max_queue_size", "priority_levels", "preferred_batch_size", "max_inflight_requests", "FP32", "BYTES",
]  # fmt: skip

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.sampled_from([*WORDS, "${X", "${}", "${A:-", "::", "host:0", "host:99999", "unix:", "-1"])
)
documents = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(WORDS) | st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)


def load(tmp: Path, text: str | bytes) -> EnsemblePlan | None:
    path = tmp / "fuzzed.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        return load_ensemble(path, environ={})
    except ConfigError as err:
        assert str(path) in str(err), f"the error does not name the file: {err}"
        return None


@SETTINGS
@given(document=documents)
def test_random_documents(tmp_path: Path, document: Any) -> None:
    load(tmp_path, yaml.safe_dump(document, allow_unicode=True))


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _paths(value, (*prefix, i))
    return found


PATHS = _paths(VALID)[1:]


@SETTINGS
@given(path=st.sampled_from(PATHS), value=documents, drop=st.booleans())
def test_mutations_of_a_valid_document(tmp_path: Path, path: tuple[Any, ...], value: Any, drop: bool) -> None:
    document = copy.deepcopy(VALID)
    parent = document
    for part in path[:-1]:
        parent = parent[part]
    if drop:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    load(tmp_path, yaml.safe_dump(document, allow_unicode=True))


@SETTINGS
@given(data=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_random_bytes(tmp_path: Path, data: bytes) -> None:
    load(tmp_path, data)


def test_the_valid_document_loads(tmp_path: Path) -> None:
    plan = load(tmp_path, yaml.safe_dump(VALID))
    assert plan is not None and plan.stages["b"].max_inflight_requests == 2

"""The fan-out step (`for_each`): a step run once per element of a tensor's first dimension, each element a
request of one item at the step model's batcher, the outputs gathered back in order, for any number of
elements (none too); written in a YAML ensemble and in Triton's `config.pbtxt` (its `parameters`), served
by a real router over a real stage service, and checked at load time."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_catalog
from pipeline.ensemble.compiler import compile_ensemble
from pipeline.ensemble.pbtxt import ensemble_config
from pipeline.ensemble.plan import ModelSignature
from pipeline.ensemble.signatures import check_signatures
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.errors import ConfigError
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, wait_serving
from tests.stages import write_model

#: N -> N items, item i = [i, i + 0.5]: a ragged count of elements per request.
SPREAD = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            items = np.array([[i, i + 0.5] for i in range(n)], np.float32).reshape(n, 2)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("ITEMS", items)]))
        return out
"""
SPREAD_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "ITEMS" data_type: TYPE_FP32 dims: [ -1, 2 ] } ]
"""

#: Squares each item (a batching model the router batches).
SQUARE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() ** 2)])
            for r in requests
        ]
"""
SQUARE_CONFIG = """
backend: "python"
max_batch_size: 64
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
"""

#: The sum of every item, and how many there were.
TOTAL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            y = pb_utils.get_input_tensor_by_name(request, "Y").as_numpy()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([y.sum()], np.float32)),
                pb_utils.Tensor("COUNT", np.array([len(y)], np.int32)),
            ]))
        return out
"""
TOTAL_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "Y" data_type: TYPE_FP32 dims: [ -1, 2 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

YAML = """
name: squares_yaml
max_batch_size: 0
inputs: [{name: N, datatype: INT32, shape: [1]}]
outputs:
  - {name: SQUARES, datatype: FP32, shape: [-1, 2]}
  - {name: SUM, datatype: FP32, shape: [1]}
  - {name: COUNT, datatype: INT32, shape: [1]}
steps:
  - {model_name: spread, input_map: {N: N}, output_map: {ITEMS: items}}
  - {model_name: square, for_each: items, input_map: {X: items}, output_map: {Y: SQUARES}}
  - {model_name: total, input_map: {Y: SQUARES}, output_map: {SUM: SUM, COUNT: COUNT}}
"""

PBTXT = """
name: "squares_pbtxt"
platform: "ensemble"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "SQUARES" data_type: TYPE_FP32 dims: [ -1, 2 ] },
  { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }
]
parameters { key: "step.1.for_each" value { string_value: "items" } }
ensemble_scheduling {
  step [
    { model_name: "spread" model_version: -1 input_map { key: "N" value: "N" } output_map { key: "ITEMS" value: "items" } },
    { model_name: "square" model_version: -1 input_map { key: "X" value: "items" } output_map { key: "Y" value: "SQUARES" } },
    { model_name: "total" model_version: -1 input_map { key: "Y" value: "SQUARES" } output_map { key: "SUM" value: "SUM" } output_map { key: "COUNT" value: "COUNT" } }
  ]
}
"""


def write_repository(root: Path) -> Path:
    write_model(root, "spread", SPREAD, SPREAD_CONFIG)
    write_model(root, "square", SQUARE, SQUARE_CONFIG)
    write_model(root, "total", TOTAL, TOTAL_CONFIG)
    (root / "squares_yaml").mkdir()
    (root / "squares_yaml" / "ensemble.yaml").write_text(YAML)
    (root / "squares_pbtxt" / "1").mkdir(parents=True)
    (root / "squares_pbtxt" / "config.pbtxt").write_text(PBTXT)
    return root


def expected(n: int) -> np.ndarray:
    return np.array([[i, i + 0.5] for i in range(n)], np.float32).reshape(n, 2) ** 2


async def test_a_step_runs_once_per_element_batched_across_requests(tmp_path: Path) -> None:
    root = write_repository(tmp_path / "repository")
    async with serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()]) as stage:
        await wait_serving(stage.address)
        catalog = load_catalog(repository=root, stages={"python": stage.address})
        async with serving_router(catalog) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            counts = [0, 1, 5, 3, 7, 0, 2, 6]
            for ensemble in ("squares_yaml", "squares_pbtxt"):
                replies = await asyncio.gather(
                    *(
                        stub.ModelInfer(request_for(ensemble, N=np.array([n], np.int32)), timeout=30)
                        for n in counts
                    )
                )
                for n, reply in zip(counts, replies, strict=True):
                    outputs = response_tensors(reply)
                    squares = outputs["SQUARES"].to_array()
                    assert squares.shape == (n, 2)
                    np.testing.assert_array_equal(squares, expected(n))  # in the elements' order
                    assert outputs["COUNT"].to_array().tolist() == [n]
                    assert outputs["SUM"].to_array().tolist() == [expected(n).sum()]
            stats = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="square"))).model_stats[0]
            # One request of one item per element, of both ensembles' 8 requests each.
            assert stats.inference_count == 2 * sum(counts)
            # The elements of concurrent requests shared batches.
            assert stats.execution_count < stats.inference_count / 2


def test_a_fan_out_step_is_checked_at_load_time() -> None:
    data = {
        "name": "e",
        "max_batch_size": 0,
        "inputs": [{"name": "N", "datatype": "INT32", "shape": [1]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 2]}],
        "steps": [
            {"model_name": "spread", "input_map": {"N": "N"}, "output_map": {"ITEMS": "items"}},
            {
                "model_name": "square",
                "for_each": "nope",
                "input_map": {"X": "items"},
                "output_map": {"Y": "Y"},
            },
        ],
    }
    with pytest.raises(ConfigError, match="for_each names tensor 'nope', which its input_map does not read"):
        compile_ensemble(data, "e.yaml")

    data["steps"][1]["for_each"] = ["items"]  # type: ignore[index]
    plan = compile_ensemble(data, "e.yaml")
    assert ensemble_config(plan).parameters["step.1.for_each"].string_value == "items"
    spread = ModelSignature(
        "spread", (TensorSpec("N", "INT32", (1,)),), (TensorSpec("ITEMS", "FP32", (-1, 2)),), 0
    )
    unbatched = ModelSignature(
        "square", (TensorSpec("X", "FP32", (-1, 2)),), (TensorSpec("Y", "FP32", (-1, 2)),), 0
    )
    with pytest.raises(
        ConfigError, match="as a request of one item, but stage model 'square' does not batch"
    ):
        check_signatures(plan, {"spread": spread, "square": unbatched})

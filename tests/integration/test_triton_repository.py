"""A repository written for Triton, served as it is: three Python-backend models chained by an ensemble in
Triton's `config.pbtxt`, each logging with `pb_utils.Logger` as Triton's documentation shows, behind the
router."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_catalog
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, wait_serving
from tests.stages import write_model

#: Each step: its model.py body for `execute` (x is the input array), its input and output.
STEPS = {
    "scale_pre": ("x.astype(np.float32) / np.float32(255.0)", ("IMAGE", "TYPE_UINT8"), ("NORM", "TYPE_FP32")),
    "scale_model": ("x.reshape(len(x), 4, -1).sum(axis=2)", ("NORM", "TYPE_FP32"), ("LOGITS", "TYPE_FP32")),
    "scale_post": (
        "x.argmax(axis=1).reshape(-1, 1).astype(np.int64)",
        ("LOGITS", "TYPE_FP32"),
        ("LABEL", "TYPE_INT64"),
    ),
}
DIMS = {"IMAGE": [4, 2], "NORM": [4, 2], "LOGITS": [4], "LABEL": [1]}

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.Logger.log_info(f"{{args['model_name']}}: initialized on {{args['model_instance_kind']}}")

    def execute(self, requests):
        try:
            xs = [pb_utils.get_input_tensor_by_name(r, "{input}").as_numpy() for r in requests]
            out = []
            for x in xs:
                y = {body}
                out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("{output}", y)]))
            return out
        except Exception as e:
            pb_utils.Logger.log_error(f"failed: {{e!r}}")
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(repr(e))) for _ in requests]
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "{input}" data_type: {input_type} dims: {input_dims} }} ]
output [ {{ name: "{output}" data_type: {output_type} dims: {output_dims} }} ]
dynamic_batching {{ max_queue_delay_microseconds: 1000 }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

ENSEMBLE = """
name: "scale"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IMAGE" data_type: TYPE_UINT8 dims: [ 4, 2 ] } ]
output [ { name: "LABEL" data_type: TYPE_INT64 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "scale_pre" model_version: -1
      input_map { key: "IMAGE" value: "IMAGE" } output_map { key: "NORM" value: "norm" } },
    { model_name: "scale_model" model_version: -1
      input_map { key: "NORM" value: "norm" } output_map { key: "LOGITS" value: "logits" } },
    { model_name: "scale_post" model_version: -1
      input_map { key: "LOGITS" value: "logits" } output_map { key: "LABEL" value: "LABEL" } }
  ]
}
"""


def write_repository(root: Path) -> Path:
    for name, (body, (input_name, input_type), (output_name, output_type)) in STEPS.items():
        source = MODEL.format(input=input_name, output=output_name, body=body)
        config = CONFIG.format(
            name=name,
            input=input_name,
            input_type=input_type,
            input_dims=DIMS[input_name],
            output=output_name,
            output_type=output_type,
            output_dims=DIMS[output_name],
        )
        write_model(root, name, source, config)
    (root / "scale" / "1").mkdir(parents=True)
    (root / "scale" / "config.pbtxt").write_text(ENSEMBLE)
    return root


async def test_a_triton_repository_loads_and_serves_unmodified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = write_repository(tmp_path / "repository")
    caplog.set_level(logging.INFO, logger="triton_python_backend_utils")
    async with serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()]) as stage:
        await wait_serving(stage.address)
        async with inference_stub(stage.address) as stub:
            index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
            assert {(m.name, m.state) for m in index.models} == {(name, "READY") for name in STEPS}
        logged = [r.getMessage() for r in caplog.records if r.name == "triton_python_backend_utils"]
        assert sorted(logged) == sorted(f"{name}: initialized on CPU" for name in STEPS)

        catalog = load_catalog(repository=root, stages={"python": stage.address})
        async with serving_router(catalog) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            images = np.zeros((3, 4, 2), np.uint8)
            images[np.arange(3), [2, 0, 3]] = 255  # the brightest row of each image is its label
            reply = await stub.ModelInfer(request_for("scale", IMAGE=images), timeout=30)
            assert response_tensors(reply)["LABEL"].to_array().ravel().tolist() == [2, 0, 3]

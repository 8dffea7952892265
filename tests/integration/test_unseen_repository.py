"""A Triton-layout repository the project has never seen, served without edits: ONNX and TorchScript models
with their `config.pbtxt`, an ONNX model with none, a Triton Python-backend stage, and an ensemble
`config.pbtxt` chaining a model and the stage. The model service and a stage service serve the one folder,
the router finds which serves what through their `RepositoryIndex`, and every answer through the router
matches the same files run in-process."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.ensemble.catalog import load_catalog
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from services.model.backend import ModelBackend
from tests.conftest import inference_stub, request_for, wait_serving
from tests.model_files import add_model, reference, write_onnx

#: Triton's Python backend, as its users write it: a softmax over Y.
SOFTMAX = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.dtype = pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, "PROB")["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            y = pb_utils.get_input_tensor_by_name(request, "Y").as_numpy()
            e = np.exp(y - y.max(axis=1, keepdims=True))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PROB", (e / e.sum(axis=1, keepdims=True)).astype(self.dtype))]))
        return responses

    def finalize(self):
        pass
"""
SOFTMAX_CONFIG = """
name: "softmax"
backend: "python"
max_batch_size: 8
input [ { name: "Y", data_type: TYPE_FP32, dims: [ 3 ] } ]
output [ { name: "PROB", data_type: TYPE_FP32, dims: [ 3 ] } ]
"""
ENSEMBLE = """
name: "classify"
platform: "ensemble"
max_batch_size: 8
input [ { name: "FEATURES", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "PROBABILITIES", data_type: TYPE_FP32, dims: [ 3 ] } ]
ensemble_scheduling {
  step [
    { model_name: "linear" model_version: -1
      input_map { key: "X" value: "FEATURES" } output_map { key: "Y" value: "logits" } },
    { model_name: "softmax" model_version: -1
      input_map { key: "Y" value: "logits" } output_map { key: "PROB" value: "PROBABILITIES" } }
  ]
}
"""


def write_repository(root: Path) -> Path:
    add_model(root, "onnx", "linear", {"1": 11})
    add_model(root, "torchscript", "scripted", {"1": 12})
    write_onnx(root / "bare" / "1" / "model.onnx", 13)  # no config.pbtxt
    (root / "softmax" / "1").mkdir(parents=True)
    (root / "softmax" / "1" / "model.py").write_text(SOFTMAX)
    (root / "softmax" / "config.pbtxt").write_text(SOFTMAX_CONFIG)
    (root / "classify" / "1").mkdir(parents=True)
    (root / "classify" / "config.pbtxt").write_text(ENSEMBLE)
    return root


async def test_an_unseen_triton_repository_is_served_as_it_is(tmp_path: Path) -> None:
    root = write_repository(tmp_path / "repository")
    repository = ModelRepository(root)
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
    async with (
        serving_stages([], repository=repository, backends=[ModelBackend(Runners(device="cpu"))]) as models,
        serving_stages([], repository=repository, backends=[PythonBackend()]) as python,
    ):
        await wait_serving(models.address, timeout=60)
        await wait_serving(python.address, timeout=60)
        catalog = load_catalog(
            [], repository=root, stages={"models": models.address, "python": python.address}
        )
        async with serving_router(catalog) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address, timeout=60)

            reply = await stub.ModelInfer(request_for("classify", FEATURES=x), timeout=30)
            logits = reference(root / "linear" / "1" / "model.onnx", {"X": x})["Y"]
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            np.testing.assert_allclose(
                response_tensors(reply)["PROBABILITIES"].to_array(),
                e / e.sum(axis=1, keepdims=True),
                rtol=1e-5,
            )

            reply = await stub.ModelInfer(request_for("scripted", INPUT__0=x), timeout=30)
            np.testing.assert_allclose(
                response_tensors(reply)["OUTPUT__0"].to_array(),
                reference(root / "scripted" / "1" / "model.pt", {"x": x})["OUTPUT__0"],
                rtol=1e-5,
                atol=1e-6,
            )

            reply = await stub.ModelInfer(request_for("bare", X=x[:4]), timeout=30)  # auto-completed: max 4
            np.testing.assert_allclose(
                response_tensors(reply)["Y"].to_array(),
                reference(root / "bare" / "1" / "model.onnx", {"X": x[:4]})["Y"],
                rtol=1e-5,
            )

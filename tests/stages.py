"""Small stage models the tests serve, Triton's `add_sub` example, and the example repository's stages."""

from __future__ import annotations

import dataclasses
import shutil
import sys
import threading
import types
from pathlib import Path

import numpy as np

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.errors import InvalidInput
from pipeline.python_backend import PythonBackend
from pipeline.repository import ModelRepository, config_text, read_config
from pipeline.stage import Stage, TensorSpec


class Scale(Stage):
    """Y = 2X on rows of 3; refuses rows with a negative value, naming the row of the batch it saw."""

    name = "scale"
    inputs = (TensorSpec("X", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def __init__(self, name: str = "scale", max_batch_size: int = 32) -> None:
        self.name = name
        self.max_batch_size = max_batch_size

    def infer(self, inputs):
        x = inputs["X"]
        bad = np.flatnonzero((x < 0).any(axis=1))
        if bad.size:
            raise InvalidInput(f"X[{bad[0]}]: negative values are not allowed")
        return {"Y": x * 2}


#: Triton's Python-backend example `add_sub` (python_backend/examples/add_sub), unmodified: a model written for
#: Triton that this project's stage services serve as it is.
TRITON_ADD_SUB_MODEL = '''\
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Your Python model must use the same class name. Every Python model
    that is created must have "TritonPythonModel" as the class name.
    """

    def initialize(self, args):
        # You must parse model_config. JSON string is not parsed here
        self.model_config = model_config = json.loads(args["model_config"])

        # Get OUTPUT0 configuration
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")

        # Get OUTPUT1 configuration
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")

        # Convert Triton types to numpy types
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        output0_dtype = self.output0_dtype
        output1_dtype = self.output1_dtype

        responses = []

        # Every Python backend must iterate over everyone of the requests
        # and create a pb_utils.InferenceResponse for each of them.
        for request in requests:
            # Get INPUT0
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            # Get INPUT1
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")

            out_0, out_1 = (
                in_0.as_numpy() + in_1.as_numpy(),
                in_0.as_numpy() - in_1.as_numpy(),
            )

            # Create output tensors. You need pb_utils.Tensor
            # objects to create pb_utils.InferenceResponse.
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(output1_dtype))

            inference_response = pb_utils.InferenceResponse(output_tensors=[out_tensor_0, out_tensor_1])
            responses.append(inference_response)

        # You should return a list of pb_utils.InferenceResponse. Length
        # of this list must match the length of `requests` list.
        return responses

    def finalize(self):
        """`finalize` is called only once when the model is being unloaded."""
        print("Cleaning up...")
'''
#: Its `config.pbtxt`, as Triton's example ships it.
TRITON_ADD_SUB_CONFIG = """\
name: "add_sub"
backend: "python"

input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
input [
  {
    name: "INPUT1"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
output [
  {
    name: "OUTPUT1"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]

instance_group [{ kind: KIND_CPU }]
"""


def write_model(root: Path, name: str, source: str, config: str | None = None, version: str = "1") -> Path:
    """Write `<root>/<name>/<version>/model.py` (and `config.pbtxt` when given); return the model.py path."""
    folder = root / name
    (folder / version).mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    path = folder / version / "model.py"
    path.write_text(source)
    return path


#: The example repository in the tree, whose stages the services serve.
EXAMPLE_REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"


def example_stage(name: str, **parameters: object) -> Stage:
    """A stage of the example repository, loaded through the python backend; `parameters` override those of
    its `config.pbtxt`."""
    entry = ModelRepository(EXAMPLE_REPOSITORY).read(name)
    if parameters:
        config = mc.ModelConfig()
        config.CopyFrom(entry.config)
        for key, value in parameters.items():
            config.parameters[key].string_value = str(value)
        entry = dataclasses.replace(entry, config=config)
    instance = PythonBackend().prepare(entry, entry.served_versions()[-1]).instances[0]
    instance.load()
    return instance.stage  # type: ignore[attr-defined]


def example_module(name: str) -> types.ModuleType:
    """The module of an example stage's `model.py`, for tests of its helper functions."""
    return sys.modules[type(example_stage(name)).__module__]


def example_repository(
    root: Path, names: list[str], parameters: dict[str, dict[str, object]] | None = None
) -> Path:
    """Copy example stages into a repository at `root`, with `parameters` (by model) set in their configs."""
    for name in names:
        shutil.copytree(EXAMPLE_REPOSITORY / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        overrides = (parameters or {}).get(name)
        if overrides:
            config_path = root / name / "config.pbtxt"
            config = read_config(config_path) if config_path.exists() else mc.ModelConfig(backend="python")
            for key, value in overrides.items():
                config.parameters[key].string_value = str(value)
            config_path.write_text(config_text(config))
    return root


#: What the `Gated` stage of the lifecycle tests records and waits on (its model.py imports this module).
GATE = {"entered": threading.Event(), "release": threading.Event(), "events": []}

GATED_MODEL = """
from pipeline.stage import Stage, TensorSpec
from tests.stages import GATE

class Gated(Stage):
    inputs = (TensorSpec("X", "FP32", (-1,)),)
    outputs = (TensorSpec("Y", "FP32", (-1,)),)

    def infer(self, inputs):
        GATE["entered"].set()
        GATE["release"].wait(30)
        GATE["events"].append("infer finished")
        return {"Y": inputs["X"]}

    def unload(self):
        GATE["events"].append("unloaded")
"""

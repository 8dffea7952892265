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
from pipeline.protocol.errors import InvalidInput
from pipeline.protocol.model_config import config_text, read_config
from pipeline.protocol.types import TensorSpec
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.api import Stage
from pipeline.stage.python_backend import PythonBackend


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


#: A model written for Triton's Python backend, as its users write them (its API only: `initialize` reads the
#: config's output types, `execute` answers each request with a `pb_utils.InferenceResponse`): this project's
#: stage services must serve it as it is. It adds and subtracts two vectors.
TRITON_ADD_SUB_MODEL = """\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.types = {
            name: pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, name)["data_type"])
            for name in ("OUTPUT0", "OUTPUT1")
        }

    def execute(self, requests):
        responses = []
        for request in requests:
            left = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            right = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            results = {"OUTPUT0": left + right, "OUTPUT1": left - right}
            tensors = [pb_utils.Tensor(name, np.asarray(value, self.types[name])) for name, value in results.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def finalize(self):
        self.types = None
"""
#: Its `config.pbtxt`, in Triton's format: two FP32 inputs and outputs of 4, no batching, a CPU instance.
TRITON_ADD_SUB_CONFIG = """\
name: "add_sub"
backend: "python"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
instance_group [ { kind: KIND_CPU } ]
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

#: What the router's repository tests' stages wait on: a call entered and its release, and a load's end.
HOLD = {"entered": threading.Event(), "release": threading.Event(), "loaded": threading.Event()}


class Held(Stage):
    """Y = X on rows of 3, once `release` is set (one instance: its requests queue behind the first)."""

    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, 3)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def __init__(self, name: str = "held") -> None:
        self.name = name
        self.entered, self.release = threading.Event(), threading.Event()

    def infer(self, inputs):
        self.entered.set()
        assert self.release.wait(60)
        return {"Y": inputs["X"]}


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

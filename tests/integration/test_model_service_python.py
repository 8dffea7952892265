"""The model service serves the Python models that ask for GPUs (`instance_group [ { kind: KIND_GPU } ]`)
beside its ONNX, PyTorch and TensorRT models, over real gRPC, and tells each instance where it runs as
Triton's Python backend does (`model_instance_kind`, `model_instance_device_id`).

This machine has no GPU. Where a test needs GPUs it tells the python backend how many are visible
(`PythonBackend(gpus=2)`) instead of counting them with torch: the model under test only reports the args it
was given and never touches CUDA, so what is checked is the placement, not a GPU's arithmetic.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Loading, ModelServiceSettings, Runners
from pipeline.stage.python_backend import PythonBackend
from pipeline.stage.service import repository_models
from pipeline.tools.testing import serving_stages
from services.model.__main__ import build_parser, served_models
from services.model.backend import ModelBackend
from tests.conftest import inference_stub, request_for, wait_serving
from tests.model_files import add_model
from tests.stages import write_model

#: A Triton Python model that answers where its instance runs: "<model_instance_kind>:<device id>".
WHERE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.where = f"{args['model_instance_kind']}:{args['model_instance_device_id']}".encode()

    def execute(self, requests):
        where = np.array([self.where], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("WHERE", where)]) for _ in requests]
"""
CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "WHERE" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def _repository(root: Path, group: str = "instance_group [ { count: 1 kind: KIND_GPU } ]") -> ModelRepository:
    """`gpu_model` (asks for GPUs), `cpu_model` (does not: a Python service's) and the ONNX model `cnn`."""
    write_model(root, "gpu_model", WHERE, CONFIG + group + "\n")
    write_model(root, "cpu_model", WHERE, CONFIG)
    add_model(root, "onnx", "cnn", {"1": 0})
    return ModelRepository(root)


@contextlib.asynccontextmanager
async def model_service(repository: ModelRepository, gpus: int) -> AsyncIterator:
    """The model service as `python -m services.model` makes it, with `gpus` GPUs visible to its python
    backend; yields an inference stub."""
    backends = [ModelBackend(Runners(device="cpu")), PythonBackend(gpus=gpus)]
    models = served_models(repository, _named(["--model-dir", str(repository.root)]))
    async with serving_stages([], repository=repository, backends=backends, models=models) as stage:
        await wait_serving(stage.address, timeout=120)
        async with inference_stub(stage.address) as stub:
            yield stub


async def _where(stub, model: str = "gpu_model") -> set[bytes]:
    """Where the instances of `model` run, asking until each of them has answered once."""
    config = (await stub.ModelConfig(pb.ModelConfigRequest(name=model))).config
    instances = sum(group.count * max(len(group.gpus), 1) for group in config.instance_group)
    seen: set[bytes] = set()
    for _ in range(50 * instances):
        reply = await stub.ModelInfer(request_for(model, X=np.array([1], np.int32)), timeout=30)
        seen.add(bytes(response_tensors(reply)["WHERE"].to_array().reshape(-1)[0]))
        if len(seen) == instances:
            break
    return seen


def test_the_model_service_loads_its_backends_models_and_the_python_models_that_ask_for_gpus(
    tmp_path: Path,
) -> None:
    repository = _repository(tmp_path)
    assert served_models(repository, _named([])) == ["cnn", "gpu_model"]
    # Triton's explicit model control: the models named, whatever their backend.
    named = _named(["--load-model", "cpu_model", "--load-model", "cnn"])
    assert served_models(repository, named) == ["cpu_model", "cnn"]


def _named(argv: list[str]) -> list[str] | None:
    """The models a model service's command line names (`--load-model`), as it reads them."""
    settings = ModelServiceSettings.parse(build_parser(), argv)
    return repository_models(settings.group(Loading))


async def test_on_a_machine_without_gpus_the_instance_runs_on_the_cpu_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    repository = _repository(tmp_path)
    with caplog.at_level(logging.WARNING):
        async with model_service(repository, gpus=0) as stub:
            index = await stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
            assert sorted(model.name for model in index.models) == ["cnn", "gpu_model"]
            assert await _where(stub) == {b"CPU:0"}
            (group,) = (await stub.ModelConfig(pb.ModelConfigRequest(name="gpu_model"))).config.instance_group
            assert group.kind == mc.ModelInstanceGroup.KIND_CPU and not group.gpus
    assert "asks for KIND_GPU, but no CUDA GPU is visible: its 1 instance(s) run on the CPU" in caplog.text


@pytest.mark.parametrize(
    ("group", "expected"),
    [
        ("instance_group [ { count: 1 kind: KIND_GPU gpus: [ 1 ] } ]", {b"GPU:1"}),
        # No GPU named: spread over the visible ones, as the model service places its other models.
        ("instance_group [ { count: 2 kind: KIND_GPU } ]", {b"GPU:0", b"GPU:1"}),
    ],
    ids=["named", "spread"],
)
async def test_gpu_instances_are_told_their_kind_and_device(tmp_path: Path, group: str, expected) -> None:
    # Two GPUs that this machine does not have (see the module docstring): the model never uses CUDA.
    async with model_service(_repository(tmp_path, group), gpus=2) as stub:
        assert await _where(stub) == expected
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="gpu_model"))).config
        assert {g.kind for g in config.instance_group} == {mc.ModelInstanceGroup.KIND_GPU}

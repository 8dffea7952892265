"""`model_warmup`: every instance runs the config's samples before its version is reported ready, for python
stages and the model service alike; a sample that fails (or cannot be built) refuses the version."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import RepositoryError
from pipeline.protocol.model_config import parse_config, tensor_specs
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from pipeline.stage.python_backend import PythonBackend
from pipeline.stage.warmup import warmup_samples
from pipeline.tools.testing import serving_stages
from services.model import instances
from services.model.backend import ModelBackend
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.model_files import ONNX_CONFIG, add_model
from tests.stages import write_model

#: Records every call it gets (the batch's X and its instance); refuses a batch holding 13.
RECORDER = """
import numpy as np
from pipeline.stage import InvalidInput, Stage, TensorSpec

CALLS = []


class Recorder(Stage):
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, 3)), TensorSpec("T", "BYTES", (-1, 1)))
    outputs = (TensorSpec("Y", "FP32", (-1, 3)),)

    def infer(self, inputs):
        CALLS.append((id(self), inputs["X"].copy(), list(inputs["T"].ravel())))
        if (inputs["X"] == 13).any():
            raise InvalidInput("X[0]: 13 is unlucky")
        return {"Y": inputs["X"] + 1}
"""

WARMUP = """
backend: "python"
instance_group [ { count: 2 kind: KIND_CPU } ]
model_warmup [
  { name: "zeros" batch_size: 2 count: 2
    inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } }
    inputs { key: "T" value: { data_type: TYPE_STRING dims: [ 1 ] zero_data: true } } },
  { name: "from a file" batch_size: 1
    inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "x.bin" } }
    inputs { key: "T" value: { data_type: TYPE_STRING dims: [ 1 ] input_data_file: "t.bin" } } }
]
"""


def _recorder(root: Path, config: str = WARMUP, x: tuple[float, ...] = (1.0, 2.0, 3.0)) -> Path:
    path = write_model(root, "recorder", RECORDER, config)
    warmup = root / "recorder" / "warmup"
    warmup.mkdir(exist_ok=True)
    (warmup / "x.bin").write_bytes(np.asarray(x, "<f4").tobytes())
    (warmup / "t.bin").write_bytes(b"\x05\x00\x00\x00hello")
    return path


def _calls(path: Path) -> list:
    module = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path))
    return module.CALLS


def _serving(root: Path, backends=None):
    return serving_stages(
        [],
        repository=ModelRepository(root),
        backends=backends or [PythonBackend()],
        options={"model_control_mode": "explicit"},
    )


async def test_every_instance_warms_up_before_the_model_is_ready(tmp_path: Path) -> None:
    path = _recorder(tmp_path)
    async with _serving(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)  # SERVING only once every model loaded
        calls = _calls(path)
        # Before any request: each of the 2 instances ran "zeros" twice, then "from a file" once.
        assert len(calls) == 6 and len({instance for instance, _, _ in calls}) == 2
        zeros = [x for _, x, _ in calls if x.shape == (2, 3)]
        assert len(zeros) == 4 and not any(x.any() for x in zeros)
        assert all(t == [b"", b""] for _, x, t in calls if x.shape == (2, 3)), (
            "BYTES zero data: empty strings"
        )
        from_file = [(x.tolist(), t) for _, x, t in calls if x.shape == (1, 3)]
        assert from_file == [([[1.0, 2.0, 3.0]], [b"hello"])] * 2
        request = request_for("recorder", X=np.ones((1, 3), np.float32), T=np.array([[b"a"]], dtype=object))
        await stub.ModelInfer(request)
        assert len(calls) == 7
        config = (await stub.ModelConfig(pb.ModelConfigRequest(name="recorder"))).config
        assert [w.name for w in config.model_warmup] == ["zeros", "from a file"]


async def test_a_failing_warm_up_refuses_the_version_with_its_reason(tmp_path: Path) -> None:
    _recorder(tmp_path, x=(13.0, 0.0, 0.0))
    async with _serving(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        [model] = (await stub.RepositoryIndex(pb.RepositoryIndexRequest())).models
        assert model.state == "UNAVAILABLE"
        assert "model_warmup 'from a file' failed on instance" in model.reason
        assert "13 is unlucky" in model.reason

        # Fixed, it loads; broken again, the load is refused and the serving version stays.
        _recorder(tmp_path)
        await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="recorder"))
        _recorder(tmp_path, x=(13.0, 0.0, 0.0))
        (tmp_path / "recorder" / "1" / "model.py").touch()
        error = await rpc_error(
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="recorder"))
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "13 is unlucky" in error.details() and "versions still serving: 1" in error.details()
        assert (await stub.ModelReady(pb.ModelReadyRequest(name="recorder"))).ready


#: A decoupled stage (its `infer` a generator): three responses per request, recording each; refuses 13
#: after its first response.
GENERATOR = """
import numpy as np
from pipeline.stage import InvalidInput, Stage, TensorSpec

SENT = []


class Generator(Stage):
    max_batch_size = 0
    inputs = (TensorSpec("X", "FP32", (3,)),)
    outputs = (TensorSpec("Y", "FP32", (3,)),)

    def infer(self, inputs):
        for step in range(3):
            if step == 1 and (inputs["X"] == 13).any():
                raise InvalidInput("X: 13 is unlucky")
            SENT.append(step)
            yield {"Y": inputs["X"] + step}
"""

GENERATOR_WARMUP = """
backend: "python"
model_warmup [ { name: "ones" batch_size: 1 count: 2
  inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "x.bin" } } } ]
"""


def _generator(root: Path, x: tuple[float, ...]) -> Path:
    path = write_model(root, "generator", GENERATOR, GENERATOR_WARMUP)
    (root / "generator" / "warmup").mkdir(exist_ok=True)
    (root / "generator" / "warmup" / "x.bin").write_bytes(np.asarray(x, "<f4").tobytes())
    return path


async def test_a_decoupled_model_warms_up_with_every_response_read(tmp_path: Path) -> None:
    path = _generator(tmp_path, (1.0, 2.0, 3.0))
    async with _serving(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        # The sample ran twice, each time to its last response, before the model was ready.
        module = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path))
        assert module.SENT == [0, 1, 2, 0, 1, 2]
        assert (await stub.ModelReady(pb.ModelReadyRequest(name="generator"))).ready


async def test_a_decoupled_models_error_response_in_warm_up_refuses_it(tmp_path: Path) -> None:
    _generator(tmp_path, (13.0, 0.0, 0.0))
    async with _serving(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        [model] = (await stub.RepositoryIndex(pb.RepositoryIndexRequest())).models
        assert model.state == "UNAVAILABLE"
        assert "model_warmup 'ones' failed on instance 0" in model.reason
        assert "13 is unlucky" in model.reason


@pytest.mark.parametrize(
    ("sample", "reason"),
    [
        ('inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }', "input 'X'"),
        (
            'inputs { key: "Z" value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } }',
            "unexpected input 'Z'",
        ),
        ('inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 3 ] } }', "no data: set zero_data"),
        ('inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ -1 ] zero_data: true } }', "must be fixed"),
        (
            'inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "../../x.bin" } }',
            "is not a file inside the model's warmup/ folder",
        ),
        (
            'inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "missing.bin" } }',
            "cannot read input_data_file",
        ),
        (
            'inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "short.bin" } }',
            "needs 12 bytes, got 4",
        ),
    ],
)
def test_a_sample_that_cannot_be_built_is_refused_naming_it(tmp_path: Path, sample: str, reason: str) -> None:
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "short.bin").write_bytes(b"\x00" * 4)
    config = parse_config(
        'name: "m" max_batch_size: 4\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
        f'model_warmup [ {{ name: "s" batch_size: 1 {sample} }} ]\n',
        "config.pbtxt",
    )
    inputs, _ = tensor_specs(config, "config.pbtxt")
    with pytest.raises(RepositoryError) as caught:
        warmup_samples(config, inputs, tmp_path, "config.pbtxt")
    assert (
        caught.value.message.startswith("config.pbtxt: model_warmup 's'") and reason in caught.value.message
    )


def test_batch_sizes_a_model_cannot_take_are_refused(tmp_path: Path) -> None:
    sample = 'inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 3 ] random_data: true } }'
    for max_batch, batch, reason in ((0, 2, "does not batch"), (4, 0, "at least 1"), (4, 5, "outside 1..4")):
        config = parse_config(
            f'name: "m" max_batch_size: {max_batch}\n'
            'input [ { name: "X" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
            'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
            f'model_warmup [ {{ name: "s" batch_size: {batch} {sample} }} ]\n',
            "config.pbtxt",
        )
        inputs, _ = tensor_specs(config, "config.pbtxt")
        with pytest.raises(RepositoryError, match=reason):
            warmup_samples(config, inputs, tmp_path, "config.pbtxt")


async def test_the_model_service_warms_up_its_instances(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ONNX_CONFIG.format(name="m") + (
        "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
        'model_warmup [ { name: "random" batch_size: 4 count: 3\n'
        '  inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 4 ] random_data: true } } } ]\n'
    )
    add_model(tmp_path, "onnx", "m", {"1": 1}, config=config)
    batches: list[tuple[int, ...]] = []
    run = instances.OnnxRuntimeInstance.run

    def counted(self, inputs, deadline=None):
        batches.append(inputs["X"].shape)
        return run(self, inputs) if deadline is None else run(self, inputs, deadline)

    monkeypatch.setattr(instances.OnnxRuntimeInstance, "run", counted)
    backend = ModelBackend(Runners(device="cpu"))
    async with _serving(tmp_path, [backend]) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address, timeout=120)
        # Each instance: its own load check (one item), then the sample's 3 runs of a batch of 4.
        assert sorted(batches) == sorted([(1, 4)] * 2 + [(4, 4)] * 6)
        await stub.ModelInfer(request_for("m", X=np.ones((1, 4), np.float32)), timeout=30)
        assert len(batches) == 9

"""The model service over real gRPC, serving Triton repositories through `services.model.backend.ModelBackend`
in-process (`serving_stages(repository=..., backends=[...])`), on the CPU.

Every artifact kind's outputs match the same file run in-process by its own runtime; configs round-trip
through `ModelConfig`; auto-complete gives the model's signature; versions, rollback, unload and instance
groups work for every kind; and every bad repository entry is refused, naming the file and the cause, while
the service keeps serving the other models.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import json_format, text_format

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from pipeline.stage.api import NO_DEADLINE
from pipeline.tools.testing import serving_stages
from services.model.backend import ModelBackend
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.model_files import KINDS, add_model, reference, write_export, write_onnx, write_torchscript

KIND_NAMES = list(KINDS)


@contextlib.asynccontextmanager
async def serving(root: Path, backend=None, **settings) -> AsyncIterator:
    """The model service serving `root` in explicit model-control mode; yields an inference stub."""
    backend = backend or ModelBackend(Runners(device="cpu", **settings))
    async with serving_stages(
        [], repository=ModelRepository(root), backends=[backend], options={"model_control_mode": "explicit"}
    ) as stage:
        await wait_serving(stage.address, timeout=120)
        async with inference_stub(stage.address) as stub:
            yield stub


async def infer(
    stub, model: str, version: str = "", **arrays: np.ndarray
) -> tuple[str, dict[str, np.ndarray]]:
    request = request_for(model, **arrays)
    request.model_version = version
    reply = await stub.ModelInfer(request, timeout=60)
    return reply.model_version, {name: t.to_array() for name, t in response_tensors(reply).items()}


async def model_config(stub, name: str) -> mc.ModelConfig:
    return (await stub.ModelConfig(pb.ModelConfigRequest(name=name))).config


async def load_error(stub, name: str, config: dict | None = None) -> grpc.aio.AioRpcError:
    request = pb.RepositoryModelLoadRequest(model_name=name)
    if config is not None:
        request.parameters["config"].string_param = json.dumps(config)
    return await rpc_error(stub.RepositoryModelLoad(request, timeout=60))


def close(got: np.ndarray, expected: np.ndarray) -> None:
    """Within 1e-4 absolute or 1e-3 relative, element by element."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert np.all(np.abs(got - expected) <= np.maximum(1e-4, 1e-3 * np.abs(expected))), np.abs(
        got - expected
    ).max()


X = np.random.default_rng(7).standard_normal((5, 4)).astype(np.float32)


# ---- the example models: every artifact kind against its in-process reference ------------------------------


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example repository as `make model` writes it: TorchScript, ONNX and torch.export files."""
    from examples.models.build import build

    root = tmp_path_factory.mktemp("examples")
    build(root, progress=False, report=lambda _: None)
    return root


def example_inputs(name: str, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    if name == "digits_cnn":
        return {"INPUT": rng.uniform(0, 16, size=(batch, 1, 8, 8)).astype(np.float32)}
    if name == "refcnn_cnn":
        return {"INPUT": rng.standard_normal((batch, 3, 64, 64)).astype(np.float32)}
    ids = rng.integers(1000, 30000, size=(batch, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[::2, 7:] = 0  # every other sentence padded
    return {"INPUT_IDS": ids, "ATTENTION_MASK": mask}


async def test_every_kind_matches_its_in_process_reference(examples: Path) -> None:
    rng = np.random.default_rng(0)
    async with serving(examples) as stub:
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        assert {(m.name, m.state) for m in index.models} == {
            ("digits_cnn", "READY"),
            ("refcnn_cnn", "READY"),
            ("minilm_encoder", "READY"),
        }
        for name, file_name, platform in (
            ("digits_cnn", "model.pt", "pytorch_libtorch"),
            ("refcnn_cnn", "model.onnx", "onnxruntime_onnx"),
            ("minilm_encoder", "model.pt2", "pytorch_torch_export"),
        ):
            config = await model_config(stub, name)
            assert config.platform == platform
            for batch in (1, config.max_batch_size):
                inputs = example_inputs(name, batch, rng)
                _, outputs = await infer(stub, name, **inputs)
                expected = reference(examples / name / "1" / file_name, inputs)
                output = config.output[0].name
                close(outputs[output], expected.get(output, expected.get("OUTPUT__0")))


# ---- configs ---------------------------------------------------------------------------------------------------

ROUND_TRIP = """
name: "tiny"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "X", data_type: TYPE_FP32, dims: [ 2, 2 ], reshape: { shape: [ 4 ] } },
  { name: "SCALE", data_type: TYPE_FP32, dims: [ 1 ], optional: true }
]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 3, 1 ], reshape: { shape: [ 3 ] } } ]
instance_group [ { count: 2, kind: KIND_CPU } ]
version_policy: { all: {} }
dynamic_batching { preferred_batch_size: [ 4 ], max_queue_delay_microseconds: 100 }
parameters [ { key: "intra_op_thread_count", value: { string_value: "1" } } ]
model_warmup [ { name: "zeros", batch_size: 2, inputs { key: "X" value: { data_type: TYPE_FP32, dims: [ 2, 2 ], zero_data: true } } } ]
model_repository_agents { agents [ { name: "checksum" } ] }
"""


async def test_a_config_is_served_and_read_back_with_its_fields(tmp_path: Path, caplog) -> None:
    folder = add_model(tmp_path, "onnx", "tiny", {"1": 1, "2": 2}, config=ROUND_TRIP)
    written = text_format.Parse(ROUND_TRIP, mc.ModelConfig())
    async with serving(tmp_path) as stub:
        config = await model_config(stub, "tiny")
        for field in (
            "name",
            "platform",
            "max_batch_size",
            "input",
            "output",
            "version_policy",
            "dynamic_batching",
            "model_warmup",
        ):
            assert getattr(config, field) == getattr(written, field), field
        assert config.backend == "onnxruntime"
        assert config.parameters["intra_op_thread_count"].string_value == "1"
        assert "onnxruntime on cpu" in config.parameters["runner_reason"].string_value
        assert [(g.kind, g.count) for g in config.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 2)]
        metadata = await stub.ModelMetadata(pb.ModelMetadataRequest(name="tiny"))
        assert list(metadata.versions) == ["1", "2"]
        # reshape: clients send [N, 2, 2] and get [N, 3, 1]; the model takes [N, 4] and gives [N, 3].
        x = X.reshape(5, 2, 2)
        version, outputs = await infer(stub, "tiny", X=x)
        assert version == "2"
        expected = reference(folder / "2" / "model.onnx", {"X": X})["Y"]
        close(outputs["Y"], expected.reshape(5, 3, 1))
        # An optional input, sent or left out.
        _, doubled = await infer(stub, "tiny", "1", X=x, SCALE=np.full((5, 1), 2, np.float32))
        close(doubled["Y"], 2 * reference(folder / "1" / "model.onnx", {"X": X})["Y"].reshape(5, 3, 1))
    assert "ignoring field(s) this service does not act on: model_repository_agents" in caplog.text


async def test_auto_complete_reads_an_onnx_file(tmp_path: Path) -> None:
    write_onnx(tmp_path / "plain" / "1" / "model.onnx", 3)
    write_onnx(tmp_path / "fixed" / "1" / "model.onnx", 3, batch=2)
    async with serving(tmp_path) as stub:
        config = await model_config(stub, "plain")
        assert config.platform == "onnxruntime_onnx" and config.max_batch_size == 4
        assert [(t.name, t.data_type, list(t.dims), t.optional) for t in config.input] == [
            ("X", mc.TYPE_FP32, [4], False),
            ("SCALE", mc.TYPE_FP32, [1], True),
        ]
        assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [("Y", mc.TYPE_FP32, [3])]
        _, outputs = await infer(stub, "plain", X=X[:4])
        close(outputs["Y"], reference(tmp_path / "plain" / "1" / "model.onnx", {"X": X[:4]})["Y"])
        error = await rpc_error(infer(stub, "plain", X=X))  # 5 > the completed max_batch_size
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A first dimension that is fixed is no batch dimension: max_batch_size stays 0.
        fixed = await model_config(stub, "fixed")
        assert fixed.max_batch_size == 0 and list(fixed.input[0].dims) == [2, 4]
        _, outputs = await infer(stub, "fixed", X=X[:2])
        close(outputs["Y"], reference(tmp_path / "fixed" / "1" / "model.onnx", {"X": X[:2]})["Y"])


async def test_auto_complete_reads_a_torch_export_program(tmp_path: Path) -> None:
    write_export(tmp_path / "program" / "1" / "model.pt2", 4)
    async with serving(tmp_path, default_max_batch_size=16) as stub:
        config = await model_config(stub, "program")
        assert config.platform == "pytorch_torch_export" and config.max_batch_size == 16
        assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [("X", mc.TYPE_FP32, [4])]
        assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [("Y", mc.TYPE_FP32, [3])]
        _, outputs = await infer(stub, "program", X=X)
        close(outputs["Y"], reference(tmp_path / "program" / "1" / "model.pt2", {"X": X})["Y"])


async def test_torchscript_without_a_config_is_refused_naming_the_fields(tmp_path: Path) -> None:
    write_torchscript(tmp_path / "script" / "1" / "model.pt", 1)
    add_model(tmp_path, "onnx", "good", {"1": 1})
    async with serving(tmp_path) as stub:
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        reasons = {m.name: (m.state, m.reason) for m in index.models}
        assert reasons["script"][0] == "UNAVAILABLE" and "TorchScript" in reasons["script"][1]
        error = await load_error(stub, "script")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        for word in ("model.pt", "TorchScript", "max_batch_size", "data_type", "dims", "INPUT__0"):
            assert word in error.details(), word
        await infer(stub, "good", X=X)


async def test_auto_complete_can_be_turned_off(tmp_path: Path) -> None:
    write_onnx(tmp_path / "plain" / "1" / "model.onnx", 3)
    async with serving(tmp_path, disable_auto_complete_config=True) as stub:
        error = await load_error(stub, "plain")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "auto-complete is off" in error.details() and "plain" in error.details()


# ---- bad entries: each refused with the file and the cause, the rest serving ---------------------------------


async def refused(
    root: Path, name: str, code: grpc.StatusCode, *words: str, config: dict | None = None
) -> str:
    """Serve `root` (which holds a good model `good`), check that `name` is reported UNAVAILABLE (unless what
    is wrong is the `config` given to the load) and that loading it is refused with `code` and `words`, and
    that `good` serves throughout."""
    add_model(root, "onnx", "good", {"1": 1})
    async with serving(root) as stub:
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        states = {m.name: m.state for m in index.models}
        assert states["good"] == "READY"
        assert config is not None or states.get(name, "UNAVAILABLE") == "UNAVAILABLE"
        error = await load_error(stub, name, config)
        assert error.code() == code, error.details()
        for word in words:
            assert word in error.details(), (word, error.details())
        _, outputs = await infer(stub, "good", X=X)
        close(outputs["Y"], reference(root / "good" / "1" / "model.onnx", {"X": X})["Y"])
        return error.details()


#: Sequence batching with a START control input, as Triton's stateful models declare it.
SEQUENCE_BATCHING = """
sequence_batching {
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
}
"""


async def test_a_sequence_control_input_the_model_file_lacks_is_refused_at_load_naming_it(
    tmp_path: Path,
) -> None:
    config = KINDS["onnx"][1].format(name="sequences") + SEQUENCE_BATCHING
    folder = add_model(tmp_path, "onnx", "sequences", {"1": 1}, config=config)
    words = (str(folder / "config.pbtxt"), "input 'START' is not one of the model's inputs")
    await refused(tmp_path, "sequences", grpc.StatusCode.INVALID_ARGUMENT, *words)


async def test_a_config_pbtxt_with_a_syntax_error(tmp_path: Path) -> None:
    config = KINDS["onnx"][1].format(name="typo").replace("max_batch_size: 8", "max_batch_size 8 }")
    folder = add_model(tmp_path, "onnx", "typo", {"1": 1}, config=config)
    await refused(tmp_path, "typo", grpc.StatusCode.INVALID_ARGUMENT, str(folder / "config.pbtxt"), "line 4")


async def test_a_default_model_filename_inside_the_version_folder(tmp_path: Path) -> None:
    config = KINDS["onnx"][1].format(name="named") + 'default_model_filename: "classifier.onnx"\n'
    folder = add_model(tmp_path, "onnx", "named", {}, config=config)
    write_onnx(folder / "1" / "classifier.onnx", 4)
    async with serving(tmp_path) as stub:
        _, outputs = await infer(stub, "named", X=X)
        close(outputs["Y"], reference(folder / "1" / "classifier.onnx", {"X": X})["Y"])
        assert (await model_config(stub, "named")).default_model_filename == "classifier.onnx"


@pytest.mark.parametrize("kind", KIND_NAMES)
async def test_a_truncated_model_file(tmp_path: Path, kind: str) -> None:
    folder = add_model(tmp_path, kind, "broken", {"1": 1})
    path = folder / "1" / KINDS[kind][0]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    cause = {
        "onnx": "not a valid ONNX model",
        "torchscript": "not a TorchScript module",
        "torch_export": "not a torch.export program",
    }
    await refused(tmp_path, "broken", grpc.StatusCode.INVALID_ARGUMENT, str(path), cause[kind])


@pytest.mark.parametrize("kind", KIND_NAMES)
async def test_config_dims_that_disagree_with_the_model(tmp_path: Path, kind: str) -> None:
    _, template, input_name, _ = KINDS[kind]
    config = template.format(name="wrong").replace("dims: [ 4 ]", "dims: [ 5 ]")
    folder = add_model(tmp_path, kind, "wrong", {"1": 1}, config=config)
    words = [str(folder / "1" / KINDS[kind][0])]
    # TorchScript files carry no shapes: the warm-up batch, shaped as the config says, is what fails.
    words += ["warm-up batch"] if kind == "torchscript" else [f"input '{input_name}'", "[-1, 5]", "[-1, 4]"]
    await refused(tmp_path, "wrong", grpc.StatusCode.INVALID_ARGUMENT, *words)


@pytest.mark.parametrize("kind", KIND_NAMES)
async def test_config_datatypes_that_disagree_with_the_model(tmp_path: Path, kind: str) -> None:
    _, template, _, output_name = KINDS[kind]
    head, _, tail = template.format(name="wrong").partition("output")
    config = head + "output" + tail.replace("TYPE_FP32", "TYPE_INT32")
    folder = add_model(tmp_path, kind, "wrong", {"1": 1}, config=config)
    words = [str(folder / "1" / KINDS[kind][0]), f"output '{output_name}'", "INT32", "FP32"]
    await refused(tmp_path, "wrong", grpc.StatusCode.INVALID_ARGUMENT, *words)


async def test_a_missing_version_folder(tmp_path: Path) -> None:
    folder = add_model(tmp_path, "onnx", "versions", {"1": 1})
    policy = {"version_policy": {"specific": {"versions": [1, 3]}}}
    await refused(tmp_path, "versions", grpc.StatusCode.NOT_FOUND, "version(s) 3", "no folder", config=policy)
    shutil.rmtree(folder / "1")
    await refused(tmp_path, "versions", grpc.StatusCode.NOT_FOUND, "no version folder", str(folder))


async def test_an_unknown_platform(tmp_path: Path) -> None:
    config = KINDS["onnx"][1].format(name="odd").replace("onnxruntime_onnx", "tensorflow_savedmodel")
    folder = add_model(tmp_path, "onnx", "odd", {"1": 1}, config=config)
    await refused(
        tmp_path,
        "odd",
        grpc.StatusCode.INVALID_ARGUMENT,
        str(folder / "config.pbtxt"),
        "unknown platform 'tensorflow_savedmodel'",
    )


async def test_a_model_file_linked_from_outside_the_repository(tmp_path: Path) -> None:
    root = tmp_path / "repository"
    outside = write_onnx(tmp_path / "elsewhere" / "model.onnx", 1)
    folder = add_model(root, "onnx", "linked", {})
    (folder / "1").mkdir()
    os.symlink(outside, folder / "1" / "model.onnx")
    await refused(
        root, "linked", grpc.StatusCode.INVALID_ARGUMENT, "leads outside the repository", str(outside)
    )


async def test_a_default_model_filename_that_leaves_the_version_folder(tmp_path: Path) -> None:
    root = tmp_path / "repository"
    write_onnx(tmp_path / "model.onnx", 1)
    config = KINDS["onnx"][1].format(name="escape") + 'default_model_filename: "../../../model.onnx"\n'
    add_model(root, "onnx", "escape", {"1": 1}, config=config)
    await refused(
        root,
        "escape",
        grpc.StatusCode.INVALID_ARGUMENT,
        "default_model_filename",
        "../../../model.onnx",
        "not a plain file name",
    )


async def test_a_tensorrt_engine_without_tensorrt(tmp_path: Path) -> None:
    folder = tmp_path / "engine"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.plan").write_bytes(b"an engine")
    await refused(
        tmp_path,
        "engine",
        grpc.StatusCode.INVALID_ARGUMENT,
        str(folder / "1" / "model.plan"),
        "needs TensorRT and a CUDA GPU",
    )


# ---- versions, rollback, unload and instances, for every kind -------------------------------------------------


class CountingBackend:
    """The service's backend, with each instance's first calls held at a barrier: a second instance can only
    release the first by running at the same time, which shows that requests spread over the instances."""

    def __init__(self, parties: int) -> None:
        self.inner = ModelBackend(Runners(device="cpu"))
        self.names = self.inner.names
        self.barrier = threading.Barrier(parties, timeout=30)
        self.ran: list[int] = []
        #: Hold calls at the barrier (off while the test checks versions one request at a time).
        self.armed = False

    def prepare(self, entry, version):
        prepared = self.inner.prepare(entry, version)
        prepared.instances = [_Held(i, self, n) for n, i in enumerate(prepared.instances)]
        return prepared


class _Held:
    def __init__(self, instance, backend: CountingBackend, number: int) -> None:
        self.instance, self.backend, self.number = instance, backend, number
        self.device, self.reason, self.inline = instance.device, instance.reason, instance.inline
        self.inline_when_brief = instance.inline_when_brief
        self.loaded = False

    def load(self) -> None:
        self.instance.load()
        self.loaded = True

    def run(self, inputs, deadline=NO_DEADLINE):
        if self.backend.armed and len(self.backend.ran) < self.backend.barrier.parties:
            self.backend.ran.append(self.number)
            self.backend.barrier.wait()
        return self.instance.run(inputs, deadline)

    def unload(self) -> None:
        self.instance.unload()


@pytest.mark.parametrize("kind", KIND_NAMES)
async def test_versions_rollback_unload_and_instances(tmp_path: Path, kind: str) -> None:
    file_name, template, input_name, output_name = KINDS[kind]
    folder = add_model(tmp_path, kind, "m", {"1": 1})

    def expected(version: str) -> np.ndarray:
        return next(iter(reference(folder / version / file_name, {"X": X}).values()))

    backend = CountingBackend(parties=2)
    async with serving(tmp_path, backend=backend) as stub:
        version, outputs = await infer(stub, "m", **{input_name: X})
        assert version == "1"
        close(outputs[output_name], expected("1"))

        # A new version is loaded and takes over.
        add_model(tmp_path, kind, "m", {"2": 2}, config=template.format(name="m"))
        await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="m"))
        version, outputs = await infer(stub, "m", **{input_name: X})
        assert version == "2"
        close(outputs[output_name], expected("2"))

        # A broken version 3 fails to load, says why, and version 2 keeps serving.
        broken = folder / "3" / file_name
        broken.parent.mkdir()
        broken.write_bytes(b"not a model")
        error = await load_error(stub, "m")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(broken) in error.details() and "still serving: 2" in error.details()
        assert (await infer(stub, "m", **{input_name: X}))[0] == "2"
        shutil.rmtree(broken.parent)

        # Unloaded: refused; loaded again with a config of its own (every version, two instances).
        await stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="m"))
        error = await rpc_error(infer(stub, "m", **{input_name: X}))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        config = text_format.Parse(template.format(name="m"), mc.ModelConfig())
        config.version_policy.all.SetInParent()
        config.instance_group.add(count=2, kind=mc.ModelInstanceGroup.KIND_CPU)
        override = json_format.MessageToJson(config)
        request = pb.RepositoryModelLoadRequest(model_name="m")
        request.parameters["config"].string_param = override
        await stub.RepositoryModelLoad(request)
        served = await model_config(stub, "m")
        assert [(g.kind, g.count) for g in served.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 2)]
        for version in ("1", "2"):
            answered, outputs = await infer(stub, "m", version, **{input_name: X})
            assert answered == version
            close(outputs[output_name], expected(version))
        # Two requests at once: each instance holds one at the barrier until the other arrives.
        backend.armed = True
        await asyncio.gather(*(infer(stub, "m", "2", **{input_name: X}) for _ in range(2)))
        assert sorted(backend.ran[:2]) == [0, 1]

"""The stage runtime's repository lifecycle through a real stage service: version policies, version
selection, a reload that changes only what changed, rollback, a config given with RepositoryModelLoad, and
RepositoryIndex's reasons."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving

SCALE = """
from pipeline.stage import Stage, TensorSpec

class Scale(Stage):
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, 2)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 2)),)

    def infer(self, inputs):
        return {{"Y": inputs["X"] * {factor}}}
"""


def serving(root: Path):
    """A stage service of `root`'s python models, in explicit model-control mode (it loads on request)."""
    return serving_stages(
        [],
        repository=ModelRepository(root),
        backends=[PythonBackend()],
        options={"model_control_mode": "explicit"},
    )


def write_version(root: Path, version: str, factor: float | str, config: str | None = None) -> None:
    folder = root / "scale" / version
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(SCALE.format(factor=factor))
    if config is not None:
        (root / "scale" / "config.pbtxt").write_text(config)


async def scaled(stub, version: str = "") -> tuple[float, str]:
    request = request_for("scale", X=np.ones((1, 2), np.float32))
    request.model_version = version
    reply = await stub.ModelInfer(request)
    return float(response_tensors(reply)["Y"].to_array()[0, 0]), reply.model_version


async def index(stub) -> list[tuple[str, str, str]]:
    reply = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
    return [(m.name, m.version, m.state) for m in reply.models]


async def test_versions_policies_reloads_and_rollback(tmp_path: Path) -> None:
    write_version(tmp_path, "1", 1, 'backend: "python"\nversion_policy { all {} }\n')
    write_version(tmp_path, "2", 2)
    async with serving(tmp_path) as stage:
        await wait_serving(stage.address)
        async with inference_stub(stage.address) as stub:
            assert await scaled(stub) == (2.0, "2"), "without a version: the newest"
            assert await scaled(stub, "1") == (1.0, "1")
            error = await rpc_error(scaled(stub, "7"))
            assert error.code() == grpc.StatusCode.NOT_FOUND and "no version '7'" in error.details()
            assert await index(stub) == [("scale", "1", "READY"), ("scale", "2", "READY")]

            # A new version and a changed one are loaded beside those serving; version 1 is left as it was.
            write_version(tmp_path, "2", 20)
            write_version(tmp_path, "3", 3)
            await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="scale"))
            assert [await scaled(stub, v) for v in ("1", "2", "3")] == [(1.0, "1"), (20.0, "2"), (3.0, "3")]

            # A broken new version: the load fails naming the file, and every version keeps serving.
            write_version(tmp_path, "4", "undefined_name")
            (tmp_path / "scale" / "4" / "model.py").write_text("raise RuntimeError('broken on purpose')\n")
            error = await rpc_error(
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="scale"))
            )
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "scale/4/model.py" in error.details() and "broken on purpose" in error.details()
            assert "versions still serving: 1, 2, 3" in error.details()
            assert await scaled(stub) == (3.0, "3")

            # A config given with the load replaces config.pbtxt for it: only version 1 now.
            config = {"backend": "python", "version_policy": {"specific": {"versions": [1]}}}
            await stub.RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(
                    model_name="scale",
                    parameters={"config": pb.ModelRepositoryParameter(string_param=json.dumps(config))},
                )
            )
            assert await scaled(stub) == (1.0, "1")
            reply = await stub.ModelConfig(pb.ModelConfigRequest(name="scale"))
            assert list(reply.config.version_policy.specific.versions) == [1]
            states = dict(((name, version), state) for name, version, state in await index(stub))
            assert states[("scale", "1")] == "READY" and states[("scale", "3")] == "UNAVAILABLE"

            bad = await rpc_error(
                stub.RepositoryModelLoad(
                    pb.RepositoryModelLoadRequest(
                        model_name="scale",
                        parameters={"config": pb.ModelRepositoryParameter(string_param="{oops")},
                    )
                )
            )
            assert (
                bad.code() == grpc.StatusCode.INVALID_ARGUMENT
                and "not a ModelConfig in JSON" in bad.details()
            )
            assert await scaled(stub) == (1.0, "1")


async def test_a_model_of_another_backend_is_neither_served_nor_loadable_here(tmp_path: Path) -> None:
    write_version(tmp_path, "1", 2)
    (tmp_path / "cnn" / "1").mkdir(parents=True)
    (tmp_path / "cnn" / "1" / "model.onnx").write_bytes(b"")
    (tmp_path / "typo").mkdir()
    (tmp_path / "typo" / "config.pbtxt").write_text("platform: 'pyhton'\n")
    async with serving(tmp_path) as stage:
        await wait_serving(stage.address)
        async with inference_stub(stage.address) as stub:
            listed = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
            by_name = {m.name: m for m in listed.models}
            assert set(by_name) == {"scale", "typo"}, "the ONNX model is another service's"
            assert (
                by_name["typo"].state == "UNAVAILABLE"
                and "unknown platform 'pyhton'" in by_name["typo"].reason
            )
            error = await rpc_error(stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="cnn")))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "backend 'onnxruntime' is not run by this service" in error.details()
            missing = await rpc_error(
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="absent"))
            )
            assert missing.code() == grpc.StatusCode.NOT_FOUND
            assert await scaled(stub) == (2.0, "1")

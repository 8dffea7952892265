"""Repository control on the stage services: RepositoryModelLoad/Unload refused unless the service runs in
explicit model-control mode or has an admin token, and a cap on every model version's instances, for the
python stages and the model service alike."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from pipeline.stage.control import DEFAULT_MAX_INSTANCES, requested_instances
from pipeline.stage.python_backend import PythonBackend
from pipeline.stage.service import python_service_parser
from pipeline.tools.testing import serving_stages
from services.model.__main__ import build_parser
from services.model.backend import ModelBackend
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.model_files import ONNX_CONFIG, add_model
from tests.stages import TRITON_ADD_SUB_CONFIG, TRITON_ADD_SUB_MODEL, write_model

EXPLICIT = {"model_control_mode": "explicit"}


def _config_parameter(config: dict) -> dict[str, pb.ModelRepositoryParameter]:
    return {"config": pb.ModelRepositoryParameter(string_param=json.dumps(config))}


def _python_stages(root: Path, options: dict | None = None):
    return serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()], options=options)


async def _add_sub_works(stub, metadata: tuple[tuple[str, str], ...] = ()) -> None:
    ones = np.ones(4, np.float32)
    await stub.ModelInfer(request_for("add_sub", INPUT0=ones, INPUT1=ones), metadata=metadata, timeout=10)


async def test_load_and_unload_are_refused_by_default_naming_the_flag(tmp_path: Path) -> None:
    write_model(tmp_path, "add_sub", TRITON_ADD_SUB_MODEL, TRITON_ADD_SUB_CONFIG)
    lifted = {"backend": "python", "parameters": {"max_image_pixels": {"string_value": "1000000000000"}}}
    async with _python_stages(tmp_path) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        for call, rpc in (
            (stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="add_sub")), "Unload"),
            (stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="add_sub")), "Load"),
            (
                stub.RepositoryModelLoad(
                    pb.RepositoryModelLoadRequest(model_name="add_sub", parameters=_config_parameter(lifted))
                ),
                "Load",
            ),
        ):
            error = await rpc_error(call)
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"RepositoryModel{rpc} is not allowed" in error.details()
            assert "--model-control-mode explicit" in error.details()
        # Nothing changed, and the router's read-only view of the repository still answers.
        await _add_sub_works(stub)
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        assert [(m.name, m.state) for m in index.models] == [("add_sub", "READY")]


async def test_explicit_mode_loads_and_unloads(tmp_path: Path) -> None:
    write_model(tmp_path, "add_sub", TRITON_ADD_SUB_MODEL, TRITON_ADD_SUB_CONFIG)
    async with _python_stages(tmp_path, EXPLICIT) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        await stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="add_sub"))
        assert not (await stub.ModelReady(pb.ModelReadyRequest(name="add_sub"))).ready
        await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="add_sub"))
        await _add_sub_works(stub)


async def test_a_config_asking_for_too_many_instances_is_refused_even_for_an_admin(tmp_path: Path) -> None:
    write_model(tmp_path, "add_sub", TRITON_ADD_SUB_MODEL, TRITON_ADD_SUB_CONFIG)
    (tmp_path / "admins").write_text("admin-token\n")
    admin = (("authorization", "Bearer admin-token"),)
    options = {"admin_tokens_file": str(tmp_path / "admins")}  # no explicit mode: the admin token enables it
    config = {
        "backend": "python",
        "input": [{"name": f"INPUT{i}", "data_type": "TYPE_FP32", "dims": [4]} for i in range(2)],
        "output": [{"name": f"OUTPUT{i}", "data_type": "TYPE_FP32", "dims": [4]} for i in range(2)],
        "instance_group": [{"count": 500, "kind": "KIND_CPU"}],
    }
    async with _python_stages(tmp_path, options) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        request = pb.RepositoryModelLoadRequest(model_name="add_sub", parameters=_config_parameter(config))
        error = await rpc_error(stub.RepositoryModelLoad(request, metadata=admin))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "asks for 500 instances" in error.details()
        assert f"limit of {DEFAULT_MAX_INSTANCES} per model version (--max-instances" in error.details()
        assert "versions still serving: 1" in error.details()
        reply = await stub.ModelConfig(pb.ModelConfigRequest(name="add_sub"), metadata=admin)
        assert [g.count for g in reply.config.instance_group] == [1]
        await _add_sub_works(stub, admin)

        config["instance_group"][0]["count"] = 2
        request = pb.RepositoryModelLoadRequest(model_name="add_sub", parameters=_config_parameter(config))
        await stub.RepositoryModelLoad(request, metadata=admin)
        reply = await stub.ModelConfig(pb.ModelConfigRequest(name="add_sub"), metadata=admin)
        assert [g.count for g in reply.config.instance_group] == [2]


async def test_the_cap_holds_at_start_up_and_is_configurable(tmp_path: Path) -> None:
    many = TRITON_ADD_SUB_CONFIG.replace("{ kind: KIND_CPU }", "{ count: 3 kind: KIND_CPU }")
    write_model(tmp_path, "add_sub", TRITON_ADD_SUB_MODEL, many)
    async with _python_stages(tmp_path, {"max_instances": 2}) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        [model] = (await stub.RepositoryIndex(pb.RepositoryIndexRequest())).models
        assert model.state == "UNAVAILABLE"
        assert "asks for 3 instances, over the limit of 2" in model.reason
    async with _python_stages(tmp_path, {"max_instances": 3}) as stage, inference_stub(stage.address) as stub:
        await wait_serving(stage.address)
        await _add_sub_works(stub)


async def test_the_model_service_caps_instances_too(tmp_path: Path) -> None:
    forty = ONNX_CONFIG.format(name="m") + "instance_group [ { count: 40 kind: KIND_CPU } ]\n"
    add_model(tmp_path, "onnx", "m", {"1": 1}, config=forty)
    backend = ModelBackend(Runners(device="cpu"))
    options = {**EXPLICIT, "max_instances": 8}
    async with serving_stages(
        [], repository=ModelRepository(tmp_path), backends=[backend], options=options
    ) as stage:
        await wait_serving(stage.address, timeout=120)
        async with inference_stub(stage.address) as stub:
            error = await rpc_error(stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="m")))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "asks for 40 instances, over the limit of 8" in error.details()


def test_instances_count_per_gpu_named() -> None:
    config = mc.ModelConfig()
    assert requested_instances(config) == 1
    config.instance_group.add(count=4, kind=mc.ModelInstanceGroup.KIND_GPU, gpus=[0, 1, 2])
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU)
    assert requested_instances(config) == 4 * 3 + 1


@pytest.mark.parametrize(
    "parser", [lambda: python_service_parser("preprocess"), build_parser], ids=["python", "model"]
)
def test_every_stage_service_takes_the_control_flags(parser, monkeypatch: pytest.MonkeyPatch) -> None:
    args = parser().parse_args([])
    assert args.model_control_mode == "none" and args.max_instances == DEFAULT_MAX_INSTANCES
    args = parser().parse_args(["--model-control-mode", "EXPLICIT", "--max-instances", "64"])
    assert args.model_control_mode == "explicit" and args.max_instances == 64
    monkeypatch.setenv("PIPELINE_MODEL_CONTROL_MODE", "explicit")
    monkeypatch.setenv("PIPELINE_MAX_INSTANCES", "4")
    args = parser().parse_args([])
    assert args.model_control_mode == "explicit" and args.max_instances == 4
    with pytest.raises(SystemExit):
        parser().parse_args(["--model-control-mode", "poll"])

"""A model reloaded through the router with another interface is served as its new config says, as Triton
serves a model loaded again: the router learns the model's signature again after the load (its inputs'
shapes, its outputs, its batching), and an ensemble that no longer fits the model is UNAVAILABLE, saying
why, until a load makes it fit again. The config the router gives for a model loads back."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_catalog
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving

#: A Triton Python model that answers each output its config declares: DOUBLE (2X), and where declared,
#: PLUS_ONE (X+1).
MODEL = """\
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.outputs = [o["name"] for o in json.loads(args["model_config"])["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            made = {"DOUBLE": x * 2, "PLUS_ONE": x + 1}
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor(n, made[n]) for n in self.outputs])
            )
        return responses
"""


def _config(width: int, *outputs: str, delay_us: int = 0, max_batch_size: int = 8) -> dict:
    """The model's config as Triton's `config` load parameter takes it: a batched model whose X is `width`
    wide, with `outputs`."""
    tensor = {"data_type": "TYPE_FP32", "dims": [width]}
    return {
        "name": "twice",
        "backend": "python",
        "max_batch_size": max_batch_size,
        "input": [{"name": "X", **tensor}],
        "output": [{"name": name, **tensor} for name in outputs],
        "dynamic_batching": {"max_queue_delay_microseconds": delay_us},
        "instance_group": [{"kind": "KIND_CPU"}],
    }


ENSEMBLE = """
name: doubled
max_batch_size: 8
stages:
  s: {{address: "{address}"}}
inputs: [{{name: IN, datatype: FP32, shape: [-1, 1]}}]
outputs: [{{name: OUT, datatype: FP32, shape: [-1, 1]}}]
steps:
  - {{model_name: twice, stage: s, input_map: {{X: IN}}, output_map: {{DOUBLE: OUT}}}}
"""


def _repository(root: Path, batching: str = "dynamic_batching { }\n") -> ModelRepository:
    folder = root / "twice"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(MODEL)
    (folder / "config.pbtxt").write_text(
        'name: "twice"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "DOUBLE" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        f"{batching}instance_group [ {{ kind: KIND_CPU }} ]\n"
    )
    return ModelRepository(root)


@contextlib.asynccontextmanager
async def _serving(
    tmp_path: Path, ensemble: str | None, batching: str = "dynamic_batching { }\n"
) -> AsyncIterator[tuple[Any, aiohttp.ClientSession]]:
    """A stage serving `twice` (its config ending with `batching`) with model control, and a router in front
    serving the `ensemble` file (None: none); yields the router's gRPC stub and an HTTP session to it."""
    async with serving_stages(
        [],
        repository=_repository(tmp_path / "models", batching),
        backends=[PythonBackend()],
        options={"model_control_mode": "explicit"},
    ) as stage:
        await wait_serving(stage.address)
        files = []
        if ensemble is not None:
            files.append(tmp_path / "doubled.yaml")
            files[0].write_text(ensemble.format(address=stage.address))
        catalog = load_catalog(files, stages={"s": stage.address})
        async with (
            serving_router(catalog, options={"model_control_mode": "explicit"}) as router,
            inference_stub(router.address) as stub,
            aiohttp.ClientSession(f"http://{router.http_address}") as http,
        ):
            await wait_serving(router.address)
            yield stub, http


async def _load(http: aiohttp.ClientSession, config: dict) -> None:
    body = {"parameters": {"config": json.dumps(config)}}
    async with http.post("/v2/repository/models/twice/load", json=body) as reply:
        assert reply.status == 200, await reply.text()


@pytest.mark.parametrize("in_ensemble", [False, True], ids=["alone", "ensemble_step"])
async def test_a_model_reloaded_with_another_interface_is_served_as_its_new_config_says(
    tmp_path, in_ensemble
):
    """`twice` is batched by its own config; alone, or also the step of an ensemble."""
    async with _serving(tmp_path, ENSEMBLE if in_ensemble else None) as (stub, http):
        x = np.array([[1.0], [2.0]], np.float32)
        reply = await stub.ModelInfer(request_for("twice", X=x), timeout=10)
        assert response_tensors(reply)["DOUBLE"].to_array().tolist() == [[2.0], [4.0]]
        if in_ensemble:
            reply = await stub.ModelInfer(request_for("doubled", IN=x), timeout=10)
            assert response_tensors(reply)["OUT"].to_array().tolist() == [[2.0], [4.0]]

        # X two wide, and a second output: the router's batcher takes the new shapes and outputs.
        await _load(http, _config(2, "DOUBLE", "PLUS_ONE", delay_us=1000))
        wide = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
        request = request_for("twice", X=wide)
        request.outputs.add(name="PLUS_ONE")
        request.outputs.add(name="DOUBLE")
        outputs = response_tensors(await stub.ModelInfer(request, timeout=10))
        assert outputs["PLUS_ONE"].to_array().tolist() == (wide + 1).tolist()
        assert outputs["DOUBLE"].to_array().tolist() == (wide * 2).tolist()
        # The old shape is refused by the router's batcher, naming what the model takes now.
        error = await rpc_error(stub.ModelInfer(request_for("twice", X=x), timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "[-1, 2]" in error.details()

        if in_ensemble:
            # The ensemble no longer fits its step's model: UNAVAILABLE, saying why.
            assert not (await stub.ModelReady(pb.ModelReadyRequest(name="doubled"))).ready
            error = await rpc_error(stub.ModelInfer(request_for("doubled", IN=x), timeout=10))
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "twice" in error.details()
            async with http.post("/v2/repository/index", json={}) as reply:
                index = {m["name"]: m for m in await reply.json()}
            assert index["doubled"]["state"] == "UNAVAILABLE" and "twice" in index["doubled"]["reason"]

        # Loaded as it was: the model takes one-wide X again, and the ensemble serves again.
        await _load(http, _config(1, "DOUBLE"))
        reply = await stub.ModelInfer(request_for("twice", X=x), timeout=10)
        assert response_tensors(reply)["DOUBLE"].to_array().tolist() == [[2.0], [4.0]]
        if in_ensemble:
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="doubled"))).ready
            reply = await stub.ModelInfer(request_for("doubled", IN=x), timeout=10)
            assert response_tensors(reply)["OUT"].to_array().tolist() == [[2.0], [4.0]]


async def test_an_ensembles_batching_that_a_model_loaded_again_no_longer_takes_makes_the_ensemble_say_so(
    tmp_path,
):
    """`twice` has no batching of its own; the ensemble batches its step up to 8. Loaded again with a
    max_batch_size of 4, the model is called request by request, and the ensemble is UNAVAILABLE, saying
    that its batches would be larger than the model takes."""
    ensemble = ENSEMBLE.replace(
        "output_map: {{DOUBLE: OUT}}}}",
        "output_map: {{DOUBLE: OUT}}, dynamic_batching: {{max_batch_size: 8}}}}",
    )
    async with _serving(tmp_path, ensemble, batching="") as (stub, http):
        x = np.array([[1.0], [2.0]], np.float32)
        reply = await stub.ModelInfer(request_for("doubled", IN=x), timeout=10)
        assert response_tensors(reply)["OUT"].to_array().tolist() == [[2.0], [4.0]]
        config = _config(1, "DOUBLE", max_batch_size=4)
        del config["dynamic_batching"]
        await _load(http, config)
        reply = await stub.ModelInfer(request_for("twice", X=x), timeout=10)
        assert response_tensors(reply)["DOUBLE"].to_array().tolist() == [[2.0], [4.0]]
        error = await rpc_error(stub.ModelInfer(request_for("doubled", IN=x), timeout=10))
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert "max_batch_size 8 is larger than the stage model's own max_batch_size 4" in error.details()


async def test_the_config_the_router_gives_loads_back_changed(tmp_path):
    """Triton's way of changing a model: read its config, change it, load it back with the `config`
    parameter. The config a Python model reports (its platform "python" among its fields) loads back."""
    async with _serving(tmp_path, None) as (stub, http):
        async with http.get("/v2/models/twice/config") as reply:
            config = await reply.json()
        assert config["platform"] == "python" and config["backend"] == "python", config
        config["dynamic_batching"]["max_queue_delay_microseconds"] = 500
        await _load(http, config)
        async with http.get("/v2/models/twice/config") as reply:
            assert (await reply.json())["dynamic_batching"]["max_queue_delay_microseconds"] == 500
        x = np.array([[1.0], [2.0]], np.float32)
        reply = await stub.ModelInfer(request_for("twice", X=x), timeout=10)
        assert response_tensors(reply)["DOUBLE"].to_array().tolist() == [[2.0], [4.0]]

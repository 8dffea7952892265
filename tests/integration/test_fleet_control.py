"""Triton's repository API at the router, across a stage's replicas: a load reaches every replica or none (a
failure on one rolls the others back), a rollout under load answers every request with the old version until
every replica has the new one, the ensembles follow their models, control is closed by default, and a replica
that comes back later is brought in line with what the fleet serves."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import time
from pathlib import Path
from urllib.parse import quote

import aiohttp
import grpc
import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving

#: A Triton Python model that answers with its own version number.
VERSIONED_MODEL = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.version = float(args["model_version"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            out = np.full_like(x, self.version)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("VERSION", out)]))
        return responses
"""
#: A version that fails to load.
BROKEN_MODEL = """\
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("this version cannot load")

    def execute(self, requests):
        return []
"""
VERSIONED_CONFIG = """\
name: "versioned"
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "VERSION" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""
ENSEMBLE = """
name: follows
max_batch_size: 0
stages:
  s: {{address: "ipv4:{a},{b}"}}
inputs: [{{name: X, datatype: FP32, shape: [1]}}]
outputs: [{{name: VERSION, datatype: FP32, shape: [1]}}]
steps:
  - {{model_name: versioned, stage: s, input_map: {{X: X}}, output_map: {{VERSION: VERSION}}}}
"""
EXPLICIT = {"model_control_mode": "explicit"}
X = np.zeros(1, np.float32)


def _repository(root: Path, *versions: tuple[str, str]) -> ModelRepository:
    folder = root / "versioned"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(VERSIONED_CONFIG)
    for version, source in versions:
        _add_version(root, version, source)
    return ModelRepository(root)


def _add_version(root: Path, version: str, source: str) -> None:
    (root / "versioned" / version).mkdir(parents=True, exist_ok=True)
    (root / "versioned" / version / "model.py").write_text(source)


def _replica(repository: ModelRepository, port: int = 0):
    return serving_stages([], repository=repository, backends=[PythonBackend()], options=EXPLICIT, port=port)


async def _version(stub, model: str = "versioned") -> float:
    reply = await stub.ModelInfer(request_for(model, X=X), timeout=10)
    return float(response_tensors(reply)["VERSION"].to_array()[0])


async def _ready_versions(address: str) -> set[str]:
    async with inference_stub(address) as stub:
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
    return {m.version for m in index.models if m.name == "versioned"}


async def _until(check, timeout: float = 15.0) -> None:
    """Wait until `check()` is true (each look costs a real round trip), or fail."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_rollout_under_load_answers_every_request_old_then_new(tmp_path):
    """Two replicas serve version 1; version 2 loaded through the router reaches both, while 8 clients call
    without stopping: no request fails, every answer before the load is 1, every answer after it is 2, and
    the two versions overlap only in a short window. The ensemble that uses the model keeps serving."""
    first_repo, second_repo = tmp_path / "a", tmp_path / "b"
    metrics = Metrics()
    async with (
        _replica(_repository(first_repo, ("1", VERSIONED_MODEL))) as first,
        _replica(_repository(second_repo, ("1", VERSIONED_MODEL))) as second,
    ):
        await wait_serving(first.address)
        await wait_serving(second.address)
        (tmp_path / "follows.yaml").write_text(ENSEMBLE.format(a=first.address, b=second.address))
        async with (
            serving_router(
                load_ensembles([tmp_path / "follows.yaml"]), options=EXPLICIT, metrics=metrics
            ) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            assert await _version(stub) == 1.0
            answers: list[tuple[float, float]] = []
            failures: list[BaseException] = []
            stop = asyncio.Event()

            async def client(model: str) -> None:
                while not stop.is_set():
                    try:
                        answers.append((time.monotonic(), await _version(stub, model)))
                    except grpc.aio.AioRpcError as err:
                        failures.append(err)

            clients = [asyncio.create_task(client("versioned" if i % 2 else "follows")) for i in range(8)]
            await _until(lambda: _true(len(answers) > 50))
            for repo in (first_repo, second_repo):
                _add_version(repo, "2", VERSIONED_MODEL)
            asked = time.monotonic()
            await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="versioned"), timeout=60)
            loaded = time.monotonic()
            count = len(answers)
            await _until(lambda: _true(len(answers) > count + 50))
            stop.set()
            await asyncio.gather(*clients)

            assert not failures, failures[:3]
            assert all(v == 1.0 for t, v in answers if t < asked)
            assert all(v == 2.0 for t, v in answers if t > loaded + 0.5)
            twos = [t for t, v in answers if v == 2.0]
            ones_after = [t for t, v in answers if v == 1.0 and t >= twos[0]]
            # Once a 2 was answered, a 1 may still come only from a call that was already on its way.
            assert not ones_after or ones_after[-1] - twos[0] < 0.5, (twos[0], ones_after[-1])
            assert await _ready_versions(first.address) == {"2"}
            assert await _ready_versions(second.address) == {"2"}
            assert await _version(stub) == 2.0
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="follows"))).ready
            assert metrics.registry.get_sample_value(
                "pipeline_repository_changes_total", {"model": "versioned", "action": "load", "outcome": "ok"}
            )


async def _true(value: bool) -> bool:
    return value


async def test_a_load_that_fails_on_one_replica_rolls_the_other_back(tmp_path):
    """Version 2 loads on the first replica and fails on the second: the load fails naming the second
    replica and why, the first is put back on version 1, and both answer 1."""
    first_repo, second_repo = tmp_path / "a", tmp_path / "b"
    async with (
        _replica(_repository(first_repo, ("1", VERSIONED_MODEL))) as first,
        _replica(_repository(second_repo, ("1", VERSIONED_MODEL))) as second,
    ):
        await wait_serving(first.address)
        await wait_serving(second.address)
        (tmp_path / "follows.yaml").write_text(ENSEMBLE.format(a=first.address, b=second.address))
        async with (
            serving_router(load_ensembles([tmp_path / "follows.yaml"]), options=EXPLICIT) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            _add_version(first_repo, "2", VERSIONED_MODEL)
            _add_version(second_repo, "2", BROKEN_MODEL)
            error = await rpc_error(
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="versioned"), timeout=60)
            )
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            assert second.address in error.details() and "this version cannot load" in error.details()
            assert f"{first.address} rolled back (serving 1 again)" in error.details()
            assert await _ready_versions(first.address) == {"1"}
            assert await _ready_versions(second.address) == {"1"}
            assert {await _version(stub) for _ in range(10)} == {1.0}
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="follows"))).ready


async def test_control_is_closed_by_default_and_unknown_models_and_parameters_are_refused(tmp_path):
    async with _replica(_repository(tmp_path / "a", ("1", VERSIONED_MODEL))) as first:
        await wait_serving(first.address)
        (tmp_path / "follows.yaml").write_text(ENSEMBLE.format(a=first.address, b=first.address))
        catalog = load_ensembles([tmp_path / "follows.yaml"])
        async with serving_router(catalog) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            error = await rpc_error(
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="versioned"))
            )
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "RepositoryModelLoad is not allowed" in error.details()
            error = await rpc_error(
                stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="versioned"))
            )
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        async with (
            serving_router(catalog, options=EXPLICIT) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            error = await rpc_error(
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="nothing"))
            )
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert "failed to load 'nothing'" in error.details()
            error = await rpc_error(
                stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="nothing"))
            )
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert "failed to unload 'nothing'" in error.details()
            odd = {"shape": pb.ModelRepositoryParameter(string_param="x")}
            error = await rpc_error(
                stub.RepositoryModelLoad(
                    pb.RepositoryModelLoadRequest(model_name="versioned", parameters=odd)
                )
            )
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "'shape'" in error.details()
            error = await rpc_error(
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="follows"))
            )
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "is an ensemble" in error.details()
            assert await _version(stub) == 1.0


async def test_over_http_an_unload_takes_the_ensemble_with_it_and_a_load_brings_both_back(tmp_path):
    async with (
        _replica(_repository(tmp_path / "a", ("1", VERSIONED_MODEL))) as first,
        _replica(_repository(tmp_path / "b", ("1", VERSIONED_MODEL))) as second,
    ):
        await wait_serving(first.address)
        await wait_serving(second.address)
        (tmp_path / "follows.yaml").write_text(ENSEMBLE.format(a=first.address, b=second.address))
        async with (
            serving_router(load_ensembles([tmp_path / "follows.yaml"]), options=EXPLICIT) as router,
            inference_stub(router.address) as stub,
            aiohttp.ClientSession(f"http://{router.http_address}") as http,
        ):
            await wait_serving(router.address)
            body = {"parameters": {"unload_dependents": True}}
            async with http.post("/v2/repository/models/versioned/unload", json=body) as reply:
                assert reply.status == 200, await reply.text()
            assert await _ready_versions(first.address) == set()
            assert await _ready_versions(second.address) == set()
            assert not (await stub.ModelReady(pb.ModelReadyRequest(name="follows"))).ready
            async with http.post("/v2/repository/index", json={}) as reply:
                index = {m["name"]: m for m in await reply.json()}
            assert index["follows"]["state"] == "UNAVAILABLE" and "versioned" in index["follows"]["reason"]
            assert index["versioned"]["state"] == "UNAVAILABLE", index

            # Back, pinned to version 1 by a config override (Triton's `config` parameter).
            _add_version(tmp_path / "a", "2", VERSIONED_MODEL)
            _add_version(tmp_path / "b", "2", VERSIONED_MODEL)
            config = {
                "name": "versioned",
                "backend": "python",
                "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
                "output": [{"name": "VERSION", "data_type": "TYPE_FP32", "dims": [1]}],
                "version_policy": {"specific": {"versions": [1]}},
            }
            body = {"parameters": {"config": json.dumps(config)}}
            async with http.post("/v2/repository/models/versioned/load", json=body) as reply:
                assert reply.status == 200, await reply.text()
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="follows"))).ready
            assert await _version(stub, "follows") == 1.0
            async with http.post("/v2/repository/index", json={"ready": True}) as reply:
                index = {(m["name"], m.get("version", "")): m for m in await reply.json()}
            assert index[("versioned", "1")]["state"] == "READY" and not index[("versioned", "1")].get(
                "reason"
            )

            # Triton's file overrides: the model's files in the request (base64 over HTTP), with its config.
            answer_7 = VERSIONED_MODEL.replace('float(args["model_version"])', "7.0")
            config["version_policy"] = {"specific": {"versions": [3]}}
            body = {
                "parameters": {
                    "config": json.dumps(config),
                    "file:3/model.py": base64.b64encode(answer_7.encode()).decode(),
                }
            }
            async with http.post("/v2/repository/models/versioned/load", json=body) as reply:
                assert reply.status == 200, await reply.text()
            assert {await _version(stub, "follows") for _ in range(10)} == {7.0}
            assert await _ready_versions(first.address) == await _ready_versions(second.address) == {"3"}

            body = {"parameters": {"unload_dependents": "yes"}}
            async with http.post("/v2/repository/models/versioned/unload", json=body) as reply:
                assert reply.status == 400 and "unload_dependents" in (await reply.json())["error"]


async def test_a_replica_that_comes_back_serves_what_the_fleet_serves_not_its_disk(tmp_path):
    """The fleet is pinned to version 1 through the router while the disks hold version 2 as the latest: the
    second replica, restarted, loads version 2 from its disk, and the router brings it back to version 1;
    meanwhile every request is answered by version 1."""
    first_repo, second_repo = tmp_path / "a", tmp_path / "b"
    versions = (("1", VERSIONED_MODEL), ("2", VERSIONED_MODEL))
    config = {
        "name": "versioned",
        "backend": "python",
        "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
        "output": [{"name": "VERSION", "data_type": "TYPE_FP32", "dims": [1]}],
        "version_policy": {"specific": {"versions": [1]}},
    }
    pinned = {"config": pb.ModelRepositoryParameter(string_param=json.dumps(config))}
    metrics = Metrics()
    async with _replica(_repository(first_repo, *versions)) as first:
        await wait_serving(first.address)
        second_cm = _replica(_repository(second_repo, *versions))
        second = await second_cm.__aenter__()
        try:
            await wait_serving(second.address)
            port = int(second.address.rpartition(":")[2])
            (tmp_path / "follows.yaml").write_text(ENSEMBLE.format(a=first.address, b=second.address))
            async with (
                serving_router(
                    load_ensembles([tmp_path / "follows.yaml"]), options=EXPLICIT, metrics=metrics
                ) as router,
                inference_stub(router.address) as stub,
            ):
                await wait_serving(router.address)
                assert await _version(stub) == 2.0
                await stub.RepositoryModelLoad(
                    pb.RepositoryModelLoadRequest(model_name="versioned", parameters=pinned), timeout=60
                )
                assert {await _version(stub) for _ in range(10)} == {1.0}

                await second_cm.__aexit__(None, None, None)
                second_cm = _replica(ModelRepository(second_repo), port=port)
                second = await second_cm.__aenter__()
                await wait_serving(second.address)
                answered = {await _version(stub) for _ in range(20)}
                await _until(lambda: _is(_ready_versions(second.address), {"1"}))
                answered |= {await _version(stub) for _ in range(20)}
                assert answered == {1.0}
                assert metrics.registry.get_sample_value(
                    "pipeline_repository_changes_total",
                    {"model": "versioned", "action": "reconcile", "outcome": "ok"},
                )
        finally:
            await second_cm.__aexit__(None, None, None)


async def _is(value, expected) -> bool:
    return await value == expected


async def test_with_admin_tokens_the_callers_token_is_what_the_replicas_check(tmp_path):
    """Router and stages with tokens, no explicit mode: an admin token enables control and passes on to the
    replicas, which check it themselves; a user token is refused at the router."""
    (tmp_path / "users").write_text("user-token\n")
    (tmp_path / "admins").write_text("admin-token\n")
    tokens = {
        "auth_tokens_file": str(tmp_path / "users"),
        "admin_tokens_file": str(tmp_path / "admins"),
        "stage_token": "router-secret",
    }
    repository = _repository(tmp_path / "a", ("1", VERSIONED_MODEL))
    stage = serving_stages([], repository=repository, backends=[PythonBackend()], options=tokens)
    async with stage as first:
        await wait_serving(first.address)
        (tmp_path / "follows.yaml").write_text(ENSEMBLE.format(a=first.address, b=first.address))
        async with (
            serving_router(load_ensembles([tmp_path / "follows.yaml"]), options=tokens) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            load = pb.RepositoryModelLoadRequest(model_name="versioned")
            error = await rpc_error(
                stub.RepositoryModelLoad(load, metadata=(("authorization", "Bearer user-token"),))
            )
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            _add_version(tmp_path / "a", "2", VERSIONED_MODEL)
            await stub.RepositoryModelLoad(
                load, metadata=(("authorization", "Bearer admin-token"),), timeout=60
            )
            assert await _ready_versions_with(first.address, "admin-token") == {"2"}


async def _ready_versions_with(address: str, token: str) -> set[str]:
    async with inference_stub(address) as stub:
        index = await stub.RepositoryIndex(
            pb.RepositoryIndexRequest(ready=True), metadata=(("authorization", f"Bearer {token}"),)
        )
    return {m.version for m in index.models if m.name == "versioned"}


async def test_the_index_folds_each_replicas_state_into_one(tmp_path):
    """One replica serves the model, the other was started without it: the router's index lists it READY
    (it is served), saying on how many replicas and naming the other; loaded through the router, it is READY
    on both and the reason is gone."""
    repository = _repository(tmp_path / "a", ("1", VERSIONED_MODEL))
    without = serving_stages(
        [], repository=repository, backends=[PythonBackend()], options=EXPLICIT, models=[]
    )
    async with _replica(repository) as first, without as second:
        await wait_serving(first.address)
        await wait_serving(second.address)
        (tmp_path / "follows.yaml").write_text(ENSEMBLE.format(a=first.address, b=second.address))
        async with (
            serving_router(load_ensembles([tmp_path / "follows.yaml"]), options=EXPLICIT) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
            (entry,) = [m for m in index.models if m.name == "versioned"]
            assert entry.state == "READY" and entry.reason == "READY on 1 of 2 replicas; 1 not listing it"
            await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="versioned"), timeout=60)
            index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
            (entry,) = [m for m in index.models if m.name == "versioned"]
            assert (entry.state, entry.reason) == ("READY", "")
            assert await _ready_versions(second.address) == {"1"}


def _add_model(root: Path, name: str) -> None:
    """A folder for model `name` (version 1 answers 1) in the repository at `root`."""
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(VERSIONED_CONFIG.replace('"versioned"', f'"{name}"'))
    (root / name / "1" / "model.py").write_text(VERSIONED_MODEL)


async def test_a_model_folder_added_after_start_up_loads_through_the_router(tmp_path):
    """The stage was given its models at start-up (as `pipeline run` places them); folders added to its
    repository later are found by the router and loaded on it, over gRPC and HTTP, then served. A folder its
    repository held at start-up for another service is still not its own."""
    root = tmp_path / "a"
    repository = _repository(root, ("1", VERSIONED_MODEL))
    _add_model(root, "elsewhere")
    stage = serving_stages(
        [], repository=repository, backends=[PythonBackend()], options=EXPLICIT, models=["versioned"]
    )
    async with stage as first:
        await wait_serving(first.address)
        (tmp_path / "follows.yaml").write_text(ENSEMBLE.format(a=first.address, b=first.address))
        async with (
            serving_router(load_ensembles([tmp_path / "follows.yaml"]), options=EXPLICIT) as router,
            inference_stub(router.address) as stub,
            aiohttp.ClientSession(f"http://{router.http_address}") as http,
        ):
            await wait_serving(router.address)
            _add_model(root, "by_grpc")
            _add_model(root, "by_http")
            await stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="by_grpc"), timeout=60)
            async with http.post("/v2/repository/models/by_http/load", json={}) as reply:
                assert reply.status == 200, await reply.text()
            assert await _version(stub, "by_grpc") == await _version(stub, "by_http") == 1.0
            error = await rpc_error(
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="elsewhere"))
            )
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert "no stage's model repository has it" in error.details()


#: What a server keeps of an aborted gRPC call where a reference cycle holds it.
SERVER_CALL_TYPES = frozenset({"RPCState", "_ServicerContext", "AbortError", "RepositoryModelLoadRequest"})


def _calls_left_to_the_collector() -> list[str]:
    """The objects of server calls that only the garbage collector would free, by type (the client's refused
    calls leave cycles of their own, with pytest's exception info: not counted)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        kept = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return [name for name in kept if name in SERVER_CALL_TYPES]


async def test_a_refused_load_keeps_nothing_of_its_request(tmp_path):
    """Loads refused for a missing token, with control off and for a bad parameter, each carrying a 4 MB
    file: nothing of them is left for the garbage collector (grpc.aio keeps an aborted call's error, whose
    frames held the request: 20 refused loads of 40 MB kept about 800 MB in the router)."""
    (tmp_path / "admins").write_text("admin-token\n")
    (tmp_path / "follows.yaml").write_text(ENSEMBLE.format(a="127.0.0.1:1", b="127.0.0.1:1"))
    catalog = load_ensembles([tmp_path / "follows.yaml"])
    file = {"file:1/model.py": pb.ModelRepositoryParameter(bytes_param=bytes(4 << 20))}
    odd = {**file, "shape": pb.ModelRepositoryParameter(string_param="x")}
    refusals = [
        ({"admin_tokens_file": str(tmp_path / "admins")}, file, grpc.StatusCode.UNAUTHENTICATED),
        ({}, file, grpc.StatusCode.FAILED_PRECONDITION),
        (EXPLICIT, odd, grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for options, parameters, code in refusals:
        async with serving_router(catalog, options=options) as router, inference_stub(router.address) as stub:
            load = pb.RepositoryModelLoadRequest(model_name="x", parameters=parameters)
            gc.collect()
            gc.disable()
            try:
                for _ in range(3):
                    assert (await rpc_error(stub.RepositoryModelLoad(load))).code() == code
                assert _calls_left_to_the_collector() == [], code
            finally:
                gc.enable()


async def test_a_name_no_repository_can_hold_gets_one_answer_from_router_and_stage(tmp_path):
    """A path, '..', an empty or an over-long name: NOT_FOUND with the same reason from the stage and from the
    router, over gRPC and HTTP (Triton 2.51 answers them as it answers a model its repository lacks)."""
    async with _replica(_repository(tmp_path / "a", ("1", VERSIONED_MODEL))) as first:
        await wait_serving(first.address)
        (tmp_path / "follows.yaml").write_text(ENSEMBLE.format(a=first.address, b=first.address))
        async with (
            serving_router(load_ensembles([tmp_path / "follows.yaml"]), options=EXPLICIT) as router,
            inference_stub(router.address) as stub,
            inference_stub(first.address) as stage,
            aiohttp.ClientSession(f"http://{router.http_address}") as http,
        ):
            await wait_serving(router.address)
            for name, why in [
                ("a/b", "not a plain name"),
                ("..", "not a plain name"),
                ("", "not a plain name"),
                (".hidden", "not a plain name"),
                ("x" * 300, "longer than a folder name may be (300 bytes, at most 255)"),
            ]:
                load = pb.RepositoryModelLoadRequest(model_name=name)
                at_stage = await rpc_error(stage.RepositoryModelLoad(load))
                at_router = await rpc_error(stub.RepositoryModelLoad(load))
                assert at_stage.code() == at_router.code() == grpc.StatusCode.NOT_FOUND, name
                assert at_stage.details() == at_router.details(), name
                assert why in at_router.details() and len(at_router.details()) < 400
                unload = pb.RepositoryModelUnloadRequest(model_name=name)
                for server in (stage, stub):
                    error = await rpc_error(server.RepositoryModelUnload(unload))
                    assert error.code() == grpc.StatusCode.NOT_FOUND and len(error.details()) < 400, name
                if name not in ("", ".."):  # no such path: aiohttp's own 404
                    async with http.post(f"/v2/repository/models/{quote(name, safe='')}/load") as reply:
                        assert reply.status == 404
                        assert (await reply.json())["error"] == at_router.details()
            assert await _version(stub) == 1.0


async def test_a_config_with_many_inputs_loaded_as_an_admin_leaves_the_other_models_alone(tmp_path):
    """`versioned` reloaded through the router with 5,000 more required inputs: another model of its stage
    answers as before; `versioned` itself refuses a request without them, and the ensemble that calls it no
    longer fits it (UNAVAILABLE), each with a short message naming the first few and how many more."""
    root = tmp_path / "a"
    repository = _repository(root, ("1", VERSIONED_MODEL))
    _add_model(root, "other")
    async with _replica(repository) as first:
        await wait_serving(first.address)
        (tmp_path / "follows.yaml").write_text(ENSEMBLE.format(a=first.address, b=first.address))
        async with (
            serving_router(load_ensembles([tmp_path / "follows.yaml"]), options=EXPLICIT) as router,
            inference_stub(router.address) as stub,
        ):
            await wait_serving(router.address)
            assert await _version(stub, "other") == await _version(stub, "follows") == 1.0
            config = {
                "name": "versioned",
                "backend": "python",
                "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}]
                + [{"name": f"IN_{i}", "data_type": "TYPE_FP32", "dims": [1]} for i in range(5000)],
                "output": [{"name": "VERSION", "data_type": "TYPE_FP32", "dims": [1]}],
            }
            parameters = {"config": pb.ModelRepositoryParameter(string_param=json.dumps(config))}
            load = pb.RepositoryModelLoadRequest(model_name="versioned", parameters=parameters)
            await stub.RepositoryModelLoad(load, timeout=120)
            assert await _version(stub, "other") == 1.0
            error = await rpc_error(_version(stub, "versioned"))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "expects input(s) IN_0, IN_1, IN_2, IN_3, IN_4, IN_5, IN_6, IN_7 and 4,992 more" in (
                error.details()
            )
            assert len(error.details()) < 300, error.details()
            error = await rpc_error(_version(stub, "follows"))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "IN_0, IN_1, IN_2, IN_3, IN_4, IN_5, IN_6, IN_7 and 4,992 more are not mapped" in (
                error.details()
            )
            assert len(error.details()) < 400, error.details()
            assert await _version(stub, "other") == 1.0

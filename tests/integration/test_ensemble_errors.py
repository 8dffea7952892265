"""One bad ensemble does not take the others down: the router's `--exit-on-error` (Triton's, default true) and
its ensemble files read again while it runs (`--repository-poll-secs`), through a real stage and router."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.errors import ConfigError
from pipeline.tools.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.stages import Scale

X = np.array([[1, 2, 3]], np.float32)


def ensemble(address: str, *, steps: int = 1, stage_input: str = "X") -> str:
    """OUT = 2^steps X through `steps` calls of the stage's 'scale'; `stage_input` names the input mapped."""
    tensors = ["X", *(f"t{i}" for i in range(1, steps)), "OUT"]
    lines = [
        f"  - {{model_name: scale, stage: s, input_map: {{{stage_input if i == 0 else 'X'}: {tensors[i]}}}, "
        f"output_map: {{Y: {tensors[i + 1]}}}}}"
        for i in range(steps)
    ]
    return (
        f'stages: {{s: {{address: "{address}"}}}}\n'
        "inputs: [{name: X, datatype: FP32, shape: [-1, 3]}]\n"
        "outputs: [{name: OUT, datatype: FP32, shape: [-1, 3]}]\n"
        "steps:\n" + "\n".join(lines) + "\n"
    )


async def index_of(stub) -> dict[str, tuple[str, str]]:
    """The router's RepositoryIndex: model -> (state, reason)."""
    reply = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
    return {model.name: (model.state, model.reason) for model in reply.models}


async def until(condition: Callable[[], Awaitable[bool]], what: str, timeout: float = 20.0) -> None:
    """Poll `condition` until it holds, failing after `timeout` seconds (the router reads its files again
    every poll interval)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await condition():
        assert loop.time() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.02)


async def out_of(stub, model: str) -> np.ndarray:
    reply = await stub.ModelInfer(request_for(model, X=X), timeout=10)
    return response_tensors(reply)["OUT"].to_array()


async def test_a_bad_ensemble_is_unavailable_with_its_reason_and_the_others_serve(tmp_path: Path) -> None:
    async with serving_stages([Scale()]) as stage:
        (tmp_path / "good.yaml").write_text(ensemble(stage.address))
        (tmp_path / "broken.yaml").write_text("inputs: [")  # not even YAML
        (tmp_path / "mismatch.yaml").write_text(ensemble(stage.address, stage_input="NOPE"))  # fails at start
        with pytest.raises(ConfigError, match=re.escape("broken.yaml: line 1, column 10: invalid YAML")):
            load_ensembles([tmp_path])  # Triton's default: any error stops the router
        catalog = load_ensembles([tmp_path], exit_on_error=False)
        options = {"exit_on_error": False}
        async with serving_router(catalog, options=options) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            np.testing.assert_array_equal(await out_of(stub, "good"), 2 * X)
            index = await index_of(stub)
            assert index["good"] == ("READY", "")
            assert index["broken"][0] == "UNAVAILABLE" and "invalid YAML" in index["broken"][1]
            assert index["mismatch"][0] == "UNAVAILABLE"
            assert "the stage model has no input 'NOPE'" in index["mismatch"][1]
            for name, reason in (("broken", "invalid YAML"), ("mismatch", "has no input 'NOPE'")):
                assert not (await stub.ModelReady(pb.ModelReadyRequest(name=name))).ready
                err = await rpc_error(stub.ModelInfer(request_for(name, X=X), timeout=10))
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert f"ensemble '{name}' is not available" in err.details() and reason in err.details()
            # Strict readiness, as Triton's: the router is not ready while an ensemble failed.
            assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
            body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
            async with aiohttp.ClientSession() as session:
                url = f"http://{router.http_address}/v2/models"
                async with session.post(f"{url}/broken/infer", json=body) as response:
                    assert response.status == 503
                    assert "invalid YAML" in (await response.json())["error"]
                async with session.get(f"{url}/mismatch/ready") as response:
                    assert response.status != 200
                async with session.post(f"{url}/good/infer", json=body) as response:
                    assert response.status == 200
                    assert (await response.json())["outputs"][0]["data"] == [2, 4, 6]


async def test_exit_on_error_stops_the_router_at_a_plan_its_stage_refuses(tmp_path: Path) -> None:
    async with serving_stages([Scale()]) as stage:
        (tmp_path / "good.yaml").write_text(ensemble(stage.address))
        (tmp_path / "mismatch.yaml").write_text(ensemble(stage.address, stage_input="NOPE"))
        async with serving_router(load_ensembles([tmp_path])) as router:
            with pytest.raises(
                ConfigError, match=re.escape("mismatch.yaml: step 0 (scale): input_map maps 'NOPE'")
            ):
                await router.task


async def test_a_changed_file_is_served_and_a_failing_one_keeps_the_last_good_plan(tmp_path: Path) -> None:
    async with serving_stages([Scale()]) as stage:
        good, broken = tmp_path / "good.yaml", tmp_path / "broken.yaml"
        good.write_text(ensemble(stage.address))
        broken.write_text("inputs: [")
        (tmp_path / "mismatch.yaml").write_text(ensemble(stage.address, stage_input="NOPE"))
        catalog = load_ensembles([tmp_path], exit_on_error=False)
        options = {"exit_on_error": False, "ensembles": [tmp_path], "repository_poll_secs": 0.05}
        async with serving_router(catalog, options=options) as router, inference_stub(router.address) as stub:
            await wait_serving(router.address)
            np.testing.assert_array_equal(await out_of(stub, "good"), 2 * X)

            async def reason(name: str, *words: str) -> bool:
                state = (await index_of(stub)).get(name, ("", ""))
                return all(word in state[1] for word in words)

            # A file that no longer loads: the last good plan serves, and the index says why.
            good.write_text("inputs: [")
            await until(lambda: reason("good", "good.yaml", "invalid YAML"), "good's failed reload listed")
            assert (await index_of(stub))["good"][0] == "READY"
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="good"))).ready
            np.testing.assert_array_equal(await out_of(stub, "good"), 2 * X)

            # A changed plan that loads: served from then on.
            good.write_text(ensemble(stage.address, steps=2))

            async def doubled_twice() -> bool:
                return bool((await out_of(stub, "good") == 4 * X).all())

            await until(doubled_twice, "good's new plan served")
            assert (await index_of(stub))["good"] == ("READY", "")

            # A plan that loads but that its stage refuses: the last good plan (two steps) goes on serving.
            good.write_text(ensemble(stage.address, steps=3, stage_input="NOPE"))
            await until(lambda: reason("good", "has no input 'NOPE'"), "good's refused plan listed")
            assert (await index_of(stub))["good"][0] == "READY"
            np.testing.assert_array_equal(await out_of(stub, "good"), 4 * X)

            # An ensemble that never served has no plan to keep: its file's failure is its reason.
            (tmp_path / "mismatch.yaml").write_text("steps: 3")
            await until(
                lambda: reason("mismatch", "missing required key 'inputs'"), "mismatch's failure listed"
            )
            assert (await index_of(stub))["mismatch"][0] == "UNAVAILABLE"

            # The ensemble that failed at start, fixed: it is served.
            broken.write_text(ensemble(stage.address))

            async def broken_ready() -> bool:
                return (await stub.ModelReady(pb.ModelReadyRequest(name="broken"))).ready

            await until(broken_ready, "broken served once fixed")
            np.testing.assert_array_equal(await out_of(stub, "broken"), 2 * X)

            # A new file is a new ensemble; a file removed takes its ensemble with it.
            (tmp_path / "extra.yaml").write_text(ensemble(stage.address, steps=3))
            broken.unlink()

            async def listed() -> bool:
                index = await index_of(stub)
                return "broken" not in index and index.get("extra", ("", ""))[0] == "READY"

            await until(listed, "extra served and broken gone")
            np.testing.assert_array_equal(await out_of(stub, "extra"), 8 * X)
            err = await rpc_error(stub.ModelInfer(request_for("broken", X=X), timeout=10))
            assert err.code() == grpc.StatusCode.NOT_FOUND

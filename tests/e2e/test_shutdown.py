"""Stopping is bounded, and nothing outlives `pipeline run`: a model that never returns does not keep its
stage (or the pipeline) from stopping, the requests it holds are answered UNAVAILABLE, and the services end
with a launcher that is SIGKILLed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.frames import port_of
from pipeline.router.front import BINARY
from pipeline.router.front import binary as front_binary
from pipeline.runtime.shutdown import FORCED_EXIT_CODE, STOPPED_MESSAGE, exit_deadline
from pipeline.tools.supervisor import stop_within
from pipeline.transport.frame_client import FrameConnection
from tests.conftest import inference_stub, request_for, wait_serving
from tests.e2e.conftest import start_service
from tests.e2e.test_processes import alive, children_of, command_of, launch, wait_gone

pytestmark = pytest.mark.e2e

#: A python stage whose execution never returns once it has begun: it says so in the file that
#: `STUCK_MARKER` names, then waits on an event nothing sets.
STUCK_MODEL = """\
import os
import threading
from pathlib import Path

from pipeline.stage import Stage, TensorSpec


class Stuck(Stage):
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, 1)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 1)),)

    def infer(self, inputs):
        Path(os.environ["STUCK_MARKER"]).touch()
        threading.Event().wait()
        return {"Y": inputs["X"]}
"""

#: The grace period and drain delay the tests stop with.
GRACE_S, DRAIN_DELAY_S = 1.0, 0.0
#: What a loaded machine may add to a bound before a test calls it broken.
SLACK_S = 15.0


def _stuck_repository(tmp: Path) -> Path:
    repository = tmp / "models"
    (repository / "stuck" / "1").mkdir(parents=True)
    (repository / "stuck" / "1" / "model.py").write_text(STUCK_MODEL)
    return repository


async def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written within {timeout}s"
        await asyncio.sleep(0.05)


def _x(value: float) -> np.ndarray:
    return np.full((1, 1), value, dtype=np.float32)


async def _one_streamed(stub, request: pb.ModelInferRequest) -> pb.ModelStreamInferResponse:
    """The first response of a stream that sends `request` and stays open."""
    sent = asyncio.Event()

    async def requests():
        yield request
        await sent.wait()  # keep the stream open: the server answers what it holds

    stream = stub.ModelStreamInfer(requests())
    try:
        return await stream.read()
    finally:
        sent.set()
        stream.cancel()


async def test_a_stage_stuck_in_its_model_answers_what_it_holds_unavailable_and_exits(tmp_path):
    marker = tmp_path / "running"
    flags = ["--grace-period", str(GRACE_S), "--drain-delay", str(DRAIN_DELAY_S), "--frames-port", "0"]
    command = ["-m", "services.postprocess", "--model-dir", str(_stuck_repository(tmp_path)), *flags]
    stage = start_service(
        "postprocess", [*command, "--load-model", "stuck"], tmp_path, env={"STUCK_MARKER": str(marker)}
    )
    try:
        await wait_serving(stage.address, timeout=60)
        async with inference_stub(stage.address) as stub:
            meta = await stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=10)
            frames_port = port_of(tuple(meta.extensions))
            assert frames_port is not None
            frames = await FrameConnection.open("127.0.0.1", frames_port, (), 1 << 26)
            # One request the instance runs and never returns from; two more, one on a stream and one on
            # the frame port (as the router sends them) wait for it.
            stuck = asyncio.ensure_future(stub.ModelInfer(request_for("stuck", "stuck", X=_x(0))))
            await _wait_for(marker)
            waiting = [
                asyncio.ensure_future(stub.ModelInfer(request_for("stuck", f"waiting-{i}", X=_x(i))))
                for i in (1, 2)
            ]
            streamed = asyncio.ensure_future(_one_streamed(stub, request_for("stuck", "streamed", X=_x(3))))
            framed = asyncio.ensure_future(frames.infer(request_for("stuck", "framed", X=_x(4)), 60.0, {}))
            # Calls on one connection arrive in order: once these are answered, the others are held.
            await stub.ServerLive(pb.ServerLiveRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await frames.infer(request_for("unknown", "after", X=_x(5)), 10.0, {})
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            stage.popen.send_signal(signal.SIGTERM)
            for call in [stuck, *waiting, framed]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(call, exit_deadline(DRAIN_DELAY_S, GRACE_S) + SLACK_S)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert info.value.details() == STOPPED_MESSAGE
            reply = await asyncio.wait_for(streamed, SLACK_S)
            assert reply.error_message == STOPPED_MESSAGE and reply.infer_response.id == "streamed"
            frames.close()
        # Its instance's thread never returns: the process ends all the same, within its bound.
        code = stage.popen.wait(exit_deadline(DRAIN_DELAY_S, GRACE_S) + SLACK_S)
        assert code == FORCED_EXIT_CODE
        log = (tmp_path / "postprocess.log").read_text()
        assert "5 requests still held after the grace period: answered UNAVAILABLE" in log, log
        assert "exiting without waiting for" in log, log
    finally:
        if stage.popen.poll() is None:
            stage.popen.kill()


def _pipeline_processes(launcher: int) -> list[int]:
    """Every process `pipeline run` started, and what they started (a router's workers)."""
    found = children_of(launcher)
    return found + [pid for child in found for pid in children_of(child)]


def test_sigterm_stops_pipeline_run_within_its_bound_with_a_model_stuck(tmp_path):
    marker = tmp_path / "running"
    env = {"STUCK_MARKER": str(marker), "PIPELINE_DRAIN_DELAY": str(DRAIN_DELAY_S)}
    launched = launch(tmp_path, _stuck_repository(tmp_path), "--grace-period", str(GRACE_S), env=env)
    process = launched.process
    processes = _pipeline_processes(process.pid)
    try:
        with grpc.insecure_channel(launched.address) as channel:
            infer = channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=pb.ModelInferRequest.SerializeToString,
                response_deserializer=pb.ModelInferResponse.FromString,
            )
            held = infer.future(request_for("stuck", "stuck", X=_x(0)))
            deadline = time.monotonic() + 60
            while not marker.exists():
                assert time.monotonic() < deadline and not held.done(), "the model never ran"
                time.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as info:
                held.result(timeout=exit_deadline(DRAIN_DELAY_S, GRACE_S) + SLACK_S)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == STOPPED_MESSAGE
        # The router, then the stages (the stuck one ends within its own bound, not killed at the launcher's).
        rest, _ = process.communicate(timeout=2 * stop_within(GRACE_S, DRAIN_DELAY_S) + SLACK_S)
        assert process.returncode == 0, rest
        assert "killing it" not in rest, rest
        wait_gone(processes, timeout=SLACK_S)
    finally:
        if process.poll() is None:
            process.kill()
        _kill(processes)


def test_the_services_end_with_a_launcher_that_is_killed(tmp_path):
    # With the compiled front where it is built (`make test` builds it): it must end with its router too.
    front = ("--front", "compiled") if front_binary() is not None else ("--front", "python")
    launched = launch(tmp_path, _stuck_repository(tmp_path), "--router-workers", "2", *front)
    processes = _pipeline_processes(launched.process.pid)
    try:
        (router,) = [pid for pid in children_of(launched.process.pid) if "pipeline router" in command_of(pid)]
        fronts = [pid for pid in children_of(router) if BINARY in command_of(pid)]
        workers = [pid for pid in children_of(router) if pid not in fronts]
        assert len(workers) == 2 and set(launched.pids.values()) <= set(processes), processes
        assert len(fronts) == (1 if front[1] == "compiled" else 0), fronts
        launched.process.kill()
        launched.process.wait(30)
        # Its stages, its router, the router's workers and its front: none left.
        wait_gone(processes, timeout=SLACK_S)
    finally:
        if launched.process.poll() is None:
            launched.process.kill()
        _kill(processes)


def _kill(pids: list[int]) -> None:
    """SIGKILL what a failed test left running of the processes it started (a pid that another process took
    since is left alone)."""
    for pid in pids:
        try:
            ours = alive(pid) and (command_of(pid).startswith(sys.executable) or BINARY in command_of(pid))
        except OSError:
            continue
        if ours:
            os.kill(pid, signal.SIGKILL)

"""Process-level behaviour: a stage killed and brought back, and `pipeline run` as the docs run it: it
serves, spreads calls over replicas, restarts what dies and gives up on what keeps dying."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from bench.hardening_supervisor import kill_under_load
from bench.hardening_supervisor import launch as launch_bench
from examples.digit_images import encode
from examples.models.digits import load_split
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.tools.client import InferenceClient, bytes_batch
from tests.e2e.conftest import ARTIFACTS, REPO, start_pipeline

pytestmark = pytest.mark.e2e


def test_a_killed_stage_is_named_and_the_pipeline_recovers_when_it_returns(tmp_path, model_dir):
    pipeline = start_pipeline(tmp_path, model_dir)
    try:
        _, _, x_test, y_test = load_split()
        image = bytes_batch([encode(x_test[0])], (-1, 1))
        with InferenceClient(pipeline.router.address) as client:
            assert client.infer("digits", {"IMAGE": image}, timeout=30)["LABEL"][0, 0] == y_test[0]
            model = pipeline.stages["model"]
            os.kill(model.popen.pid, signal.SIGKILL)
            model.popen.wait(10)
            with pytest.raises(grpc.RpcError) as info:
                client.infer("digits", {"IMAGE": image}, timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stage 'model'" in info.value.details() and model.address in info.value.details()
            # the router itself keeps serving
            assert client.stub.ServerLive(pb.ServerLiveRequest(), timeout=5).live
            port = int(model.address.rsplit(":", 1)[1])
            pipeline.start_stage("model", port=port)
            deadline = time.monotonic() + 60
            while True:
                try:
                    label = client.infer("digits", {"IMAGE": image}, timeout=30)["LABEL"][0, 0]
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                    time.sleep(0.2)
            assert label == y_test[0]
    finally:
        pipeline.stop()


class Launched(NamedTuple):
    process: subprocess.Popen[str]
    address: str  # the router's
    http: str  # the router's HTTP/REST base URL
    pids: dict[str, int]  # by stage process name
    addresses: dict[str, str]  # by stage process name


def launch(
    tmp_path, model_dir, *extra: str, env: dict[str, str] | None = None, output: list[str] | None = None
) -> Launched:
    """`pipeline run` on ports the OS picks, as far as its "serving" line (`env`: more environment; `output`
    gets the lines it wrote until then)."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline",
            "run",
            "--port",
            "0",
            "--preprocess-port",
            "0",
            "--model-port",
            "0",
            "--postprocess-port",
            "0",
            "--http-port",
            "0",
            "--model-dir",
            str(model_dir),
            "--grace-period",
            "2",
            *extra,
        ],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = [] if output is None else output
    deadline = time.monotonic() + 180
    for line in process.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if line.startswith("pipeline: serving"):
            break
        assert time.monotonic() < deadline, "".join(lines)
    else:
        raise AssertionError(f"pipeline run exited early:\n{''.join(lines)}")
    address = re.search(r" on (\S+) \(gRPC", line).group(1)
    http = re.search(r" and (\S+) \(HTTP/REST\)", line).group(1)
    stages = re.findall(r"([\w-]+) (\S+) \(pid (\d+)\)", line)
    return Launched(
        process,
        address,
        http,
        {name: int(pid) for name, _, pid in stages},
        {name: at for name, at, _ in stages},
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if alive(p)]}"
        time.sleep(0.1)


def test_make_run_builds_the_models_serves_and_stops_cleanly_on_sigterm(tmp_path):
    # What `make run` does on a fresh clone: the repository holds configs and stages, not model files.
    models = tmp_path / "models"
    shutil.copytree(REPO / "model_repository", models, ignore=ARTIFACTS)
    assert not (models / "digits_cnn" / "1" / "model.pt").exists()
    build = [
        sys.executable,
        "-m",
        "examples.models.build",
        "--model-dir",
        str(models),
        "--missing",
        "--no-progress",
    ]
    subprocess.run(build, cwd=REPO, check=True, timeout=600)
    process, address, http, pids, _ = launch(tmp_path, models)
    assert set(pids) == {"preprocess", "model", "postprocess"}
    try:
        assert (models / "digits_cnn" / "1" / "model.pt").exists()
        with urllib.request.urlopen(f"{http}/v2/models/digits/ready", timeout=10) as reply:
            assert reply.status == 200  # the HTTP/REST side is served too
        _, _, x_test, y_test = load_split()
        with InferenceClient(address) as client:
            out = client.infer("digits", {"IMAGE": bytes_batch([encode(x_test[1])], (-1, 1))}, timeout=30)
        assert out["LABEL"][0, 0] == y_test[1]
        # The streaming example too: its generator in the model service, its text through postprocess.
        command = [sys.executable, "-m", "pipeline", "infer", "--url", address, "-m", "textgen", "--stream"]
        command += ["--value", "PROMPT=To be", "--value", "MAX_TOKENS=12"]
        streamed = subprocess.run(command, cwd=REPO, capture_output=True, timeout=120, check=True)
        assert len(streamed.stdout.decode("ascii")) == 13
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
        assert process.returncode == 0, rest
        wait_gone(pids.values())
    finally:
        if process.poll() is None:
            process.kill()


async def test_a_model_replica_killed_under_load_is_restarted_and_no_request_fails(tmp_path, model_dir):
    """32 clients; one of two model replicas SIGKILLed. The router retries the calls that were in flight to
    it on the other replica, which answers alone until the launcher has the first one serving again on its
    port: no request may fail, and the restarted replica takes calls again."""
    launched = launch_bench(model_dir, tmp_path / "pipeline.log", "--replicas", "model=2")
    try:
        figures = await kill_under_load(launched, duration=12, kill_at=3, clients=32)
    finally:
        code = launched.stop()
    print(figures)
    assert (
        figures["answered_before_the_kill"] > 0 and figures["answered"] > figures["answered_before_the_kill"]
    )
    assert figures["failed"] == 0, figures
    assert figures["taking_calls_again_s"] is not None, launched.output()[-3000:]
    assert figures["launcher_said_so"], launched.output()[-3000:]
    assert code == 0


def test_a_killed_router_is_started_again_on_its_ports(tmp_path, model_dir):
    process, address, http, pids, _ = launch(tmp_path, model_dir)
    try:
        (router,) = [pid for pid in children_of(process.pid) if "pipeline router" in command_of(pid)]
        os.kill(router, signal.SIGKILL)
        _, _, x_test, y_test = load_split()
        image = {"IMAGE": bytes_batch([encode(x_test[3])], (-1, 1))}
        deadline = time.monotonic() + 120
        with InferenceClient(address) as client:
            while True:  # the same address, once the launcher has started the router again
                try:
                    assert client.infer("digits", image, timeout=10)["LABEL"][0, 0] == y_test[3]
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                    time.sleep(0.2)
        with urllib.request.urlopen(f"{http}/v2/health/live", timeout=10) as reply:
            assert reply.status == 200  # and the same HTTP port
        assert all(alive(pid) for pid in pids.values()), "the stages served on"
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
        assert process.returncode == 0, rest
        assert re.search(rf"router \(pid {router}\) exited with code -9 \(SIGKILL\)", rest), rest
    finally:
        if process.poll() is None:
            process.kill()


def test_pipeline_run_spreads_calls_over_stage_replicas(tmp_path, model_dir):
    process, address, _, pids, addresses = launch(tmp_path, model_dir, "--replicas", "preprocess=2")
    try:
        assert set(pids) == {"preprocess-1", "preprocess-2", "model", "postprocess"}
        _, _, x_test, y_test = load_split()

        def classify(i: int) -> None:
            i %= 12  # the first twelve held-out digits, which the model gets right
            out = client.infer("digits", {"IMAGE": bytes_batch([encode(x_test[i])], (-1, 1))}, timeout=30)
            assert out["LABEL"][0, 0] == y_test[i]

        # Calls at once: the router sends each to the replica expected to answer first, so both get some
        # (one at a time, the quicker replica may take them all).
        with InferenceClient(address) as client, ThreadPoolExecutor(6) as pool:
            list(pool.map(classify, range(24)))
        counts = []
        for name in ("preprocess-1", "preprocess-2"):
            with InferenceClient(addresses[name]) as replica:
                stats = replica.stub.ModelStatistics(
                    pb.ModelStatisticsRequest(name="digits_preprocess"), timeout=5
                )
            counts.append(stats.model_stats[0].inference_count)
        assert sum(counts) == 24 and min(counts) >= 1, counts
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)


def test_pipeline_run_with_tokens_set(tmp_path, model_dir):
    """Tokens in the environment: every service asks for one, and the router reaches its stages with the
    token the launcher made for it."""
    process, address, _, _, addresses = launch(
        tmp_path, model_dir, env={"PIPELINE_AUTH_TOKENS": "client-token"}
    )
    try:
        _, _, x_test, y_test = load_split()
        image = {"IMAGE": bytes_batch([encode(x_test[2])], (-1, 1))}
        with InferenceClient(address, token="client-token") as client:
            assert client.infer("digits", image, timeout=30)["LABEL"][0, 0] == y_test[2]
        for at in (address, addresses["model"]):  # the router, and a stage
            with InferenceClient(at) as anonymous, pytest.raises(grpc.RpcError) as info:
                anonymous.stub.ModelMetadata(pb.ModelMetadataRequest(name="digits_cnn"), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, at
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)


#: A python stage whose load never finishes.
STUCK_MODEL = """\
import threading

from pipeline.stage import Stage, TensorSpec


class Stuck(Stage):
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, 1)),)
    outputs = (TensorSpec("Y", "FP32", (-1, 1)),)

    def load(self) -> None:
        threading.Event().wait()

    def infer(self, inputs):
        return {"Y": inputs["X"]}
"""


def command_of(pid: int) -> str:
    """A process's command line, its arguments separated by spaces."""
    return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def test_pipeline_run_stops_at_once_on_sigterm_while_a_stage_is_still_loading(tmp_path):
    repository = tmp_path / "models"
    (repository / "stuck" / "1").mkdir(parents=True)
    (repository / "stuck" / "1" / "model.py").write_text(STUCK_MODEL)
    command = [
        sys.executable,
        "-m",
        "pipeline",
        "run",
        "--model-dir",
        str(repository),
        "--startup-timeout",
        "900",
    ]
    for flag in ("--port", "--preprocess-port", "--model-port", "--postprocess-port", "--http-port"):
        command += [flag, "0"]
    process = subprocess.Popen(
        [*command, "--grace-period", "1"],
        cwd=REPO,
        # Every stage serves the repository: preprocess and postprocess load `stuck` and never finish.
        env={**os.environ, "PIPELINE_MODEL_DIR": str(repository)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in process.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "waiting for preprocess to become healthy" in line:
                break
        else:
            raise AssertionError(f"pipeline run exited before waiting for its stages:\n{''.join(lines)}")
        services = children_of(process.pid)
        assert len(services) == 4, (services, "".join(lines))  # three stages and the router
        process.send_signal(signal.SIGTERM)
        # Far less than --startup-timeout: the wait ends at once, then each service gets its grace period.
        rest, _ = process.communicate(timeout=120)
        assert process.returncode == 0, "".join(lines) + rest
        assert "pipeline: serving" not in rest
        wait_gone(services)
    finally:
        if process.poll() is None:
            process.kill()

"""With TLS configured, no port of any service takes plaintext inference.

Each service (the three stages and the router) runs as its own process with TLS, bearer tokens, a metrics
port and (the router) an HTTP/REST port. Every TCP socket each process listens on is found from
`/proc/PID/net/tcp*` and the process's own file descriptors, whatever opened it, and is sent, in plaintext
and with a valid token, a gRPC `ModelInfer`, a frame `HELLO` and request, and an HTTP `POST .../infer`: none
may answer. The same requests over TLS are answered, so a port that took plaintext would fail the test.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.frames import AUTHORIZATION, HEADER, HELLO, REQUEST, RESPONSE, frame, port_of
from pipeline.runtime.security import client_tls
from tests.conftest import request_for
from tests.e2e.conftest import REPO, Process, start_service
from tests.integration.test_security import certs

__all__ = ["certs"]  # the fixture, shared with test_security

pytestmark = pytest.mark.e2e

TOKEN = "user-token"
#: What each service serves, and a request it answers: (model, input name, datatype, array).
IMAGE = np.zeros((1, 3, 64, 64), np.uint8)
SERVED: dict[str, tuple[str, str, str, np.ndarray]] = {
    "router": ("refcnn", "IMAGE", "UINT8", IMAGE),
    "preprocess": ("refcnn_preprocess", "IMAGE", "UINT8", IMAGE),
    "model": ("refcnn_cnn", "INPUT", "FP32", np.zeros((1, 3, 64, 64), np.float32)),
    "postprocess": ("refcnn_postprocess", "LOGITS", "FP32", np.zeros((1, 10), np.float32)),
}
REFCNN = ("refcnn", "refcnn_preprocess", "refcnn_cnn", "refcnn_postprocess")


@pytest.fixture(scope="module")
def refcnn_repository(tmp_path_factory) -> Path:
    """The refcnn ensemble and its three models, the CNN's file built."""
    from examples.models.build import build

    folder = tmp_path_factory.mktemp("repository")
    for name in REFCNN:
        shutil.copytree(REPO / "model_repository" / name, folder / name)
    build(folder, ["refcnn_cnn"], progress=False, report=lambda _: None)
    return folder


# --- what a process listens on -------------------------------------------------------------------------


def _family(pid: int) -> list[int]:
    """A process and its descendants."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").iterdir():
            children = (task / "children").read_text().split()
            queue.extend(int(child) for child in children)
    return found


def listening_ports(pid: int) -> set[int]:
    """The TCP ports the process (and any process it started) listens on, IPv4 and IPv6: the sockets among
    its file descriptors whose state in `/proc/PID/net/tcp*` is LISTEN."""
    ports = set()
    for member in _family(pid):
        inodes = set()
        for fd in Path(f"/proc/{member}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/{member}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    ports.add(int(local.rpartition(":")[2], 16))
    return ports


# --- inference, plaintext or not -----------------------------------------------------------------------


def infer_request(service: str) -> pb.ModelInferRequest:
    model, name, _, array = SERVED[service]
    return request_for(model, "probe", **{name: array})


def grpc_answers(port: int, service: str, credentials: grpc.ChannelCredentials | None) -> bool:
    """Whether `port` answers a ModelInfer over gRPC (plaintext where `credentials` is None)."""
    address = f"127.0.0.1:{port}"
    channel = (
        grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(infer_request(service), metadata=((AUTHORIZATION, f"Bearer {TOKEN}"),), timeout=5)
        except grpc.RpcError:
            return False
    return True


def frames_answer(port: int, service: str, tls: ssl.SSLContext | None) -> bool:
    """Whether `port` answers a frame HELLO carrying the token, then a request (plaintext where `tls` is
    None): a RESPONSE frame to the request, without an error."""
    hello = pb.ModelInferRequest(id="hello")
    hello.parameters[AUTHORIZATION].string_param = f"Bearer {TOKEN}"
    sent = frame(HELLO, hello.SerializeToString()) + frame(
        REQUEST, infer_request(service).SerializeToString()
    )
    received = bytearray()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            stream = raw if tls is None else tls.wrap_socket(raw, server_hostname="localhost")
            stream.sendall(sent)
            while chunk := stream.recv(1 << 16):
                received += chunk
                if _answered(received):
                    return True
    except (OSError, ssl.SSLError):
        pass  # refused, reset or timed out: no answer
    return _answered(received)


def _answered(data: bytearray) -> bool:
    at = 0
    while len(data) - at >= HEADER.size:
        length, kind = HEADER.unpack_from(data, at)
        end = at + HEADER.size + length
        if kind != RESPONSE or len(data) < end:
            return False
        try:
            reply = pb.ModelStreamInferResponse.FromString(bytes(data[at + HEADER.size : end]))
        except Exception:
            return False
        if reply.infer_response.id == "probe" and not reply.error_message:
            return True
        at = end
    return False


def http_answers(port: int, service: str, tls: ssl.SSLContext | None) -> bool:
    """Whether `port` answers `POST /v2/models/<model>/infer` with outputs (plaintext where `tls` is None)."""
    model, name, datatype, array = SERVED[service]
    body = {
        "inputs": [
            {"name": name, "datatype": datatype, "shape": list(array.shape), "data": array.ravel().tolist()}
        ]
    }
    if tls is None:
        connection: http.client.HTTPConnection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    else:
        connection = http.client.HTTPSConnection("localhost", port, timeout=5, context=tls)
    try:
        connection.request(
            "POST",
            f"/v2/models/{model}/infer",
            body=json.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        )
        reply = connection.getresponse()
        return reply.status == 200 and "outputs" in json.loads(reply.read())
    except (OSError, ValueError, http.client.HTTPException):
        return False
    finally:
        connection.close()


# --- the services --------------------------------------------------------------------------------------


def wait_serving(address: str, credentials: grpc.ChannelCredentials, process: Process, timeout: float = 120):
    deadline = time.monotonic() + timeout
    with grpc.secure_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            assert process.popen.poll() is None, f"{process.name} exited with {process.popen.returncode}"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"{process.name} not SERVING within {timeout}s"
            time.sleep(0.1)


def start(
    name: str, command: list[str], tmp: Path, flags: list[str], env: dict[str, str]
) -> tuple[Process, int]:
    """Start a service with `flags` and a metrics port the OS picks; returns it and its metrics port."""
    metrics_file = tmp / f"{name}.metrics"
    process = start_service(
        name,
        [*command, *flags, "--metrics-port", "0", "--metrics-port-file", str(metrics_file)],
        tmp,
        env,
    )
    return process, int(metrics_file.read_text())


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in reversed(started):
        process.stop()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_no_port_of_any_service_takes_plaintext_inference(
    certs, refcnn_repository, tmp_path, processes, mutual
):
    served = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem")]
    if mutual:
        served += ["--tls-ca", str(certs / "ca.pem")]
    identity = ("client.pem", "client-key.pem") if mutual else (None, None)
    tls = client_tls(certs / "ca.pem", *(certs / f if f else None for f in identity))
    assert tls is not None
    stage_tls = ["--stage-tls-ca", str(certs / "ca.pem")]
    stage_tls += [
        "--stage-tls-cert",
        str(certs / "client.pem"),
        "--stage-tls-key",
        str(certs / "client-key.pem"),
    ]
    env = {"PIPELINE_AUTH_TOKENS": TOKEN, "PIPELINE_STAGE_TOKEN": "router-secret"}
    repository = ["--model-dir", str(refcnn_repository)]

    known: dict[str, set[int]] = {}
    every: dict[str, Process] = {}
    for name in ("preprocess", "model", "postprocess"):
        process, metrics = start(name, ["-m", f"services.{name}", *repository], tmp_path, served, env)
        processes.append(process)
        every[name] = process
        known[name] = {int(process.address.rpartition(":")[2]), metrics}
    for name in ("preprocess", "model", "postprocess"):
        env[f"{name.upper()}_ADDRESS"] = every[name].address
    router, metrics = start(
        "router", ["-m", "pipeline", "router", *repository], tmp_path, served + stage_tls, env
    )
    processes.append(router)
    every["router"] = router
    assert router.http_address is not None
    known["router"] = {
        int(router.address.rpartition(":")[2]),
        metrics,
        int(router.http_address.rpartition(":")[2]),
    }

    for name, process in every.items():
        wait_serving(process.address, tls.credentials, process)
        ports = listening_ports(process.popen.pid)
        for port in sorted(ports):
            assert not grpc_answers(port, name, None), f"{name} port {port} answers plaintext gRPC"
            assert not frames_answer(port, name, None), f"{name} port {port} answers plaintext frames"
            assert not http_answers(port, name, None), f"{name} port {port} answers plaintext HTTP"

        # Every port the process names was found, and the requests are good ones: over TLS they are answered.
        assert grpc_answers(int(process.address.rpartition(":")[2]), name, tls.credentials), name
        if name == "router":
            assert http_answers(int(router.http_address.rpartition(":")[2]), name, tls.ssl_context)
        else:  # a stage's frame port, which it names in its metadata
            with grpc.secure_channel(process.address, tls.credentials) as channel:
                meta = pb_grpc.GRPCInferenceServiceStub(channel).ServerMetadata(
                    pb.ServerMetadataRequest(), metadata=((AUTHORIZATION, f"Bearer {TOKEN}"),), timeout=10
                )
            frames = port_of(tuple(meta.extensions))
            assert frames is not None, name
            known[name].add(frames)
            assert frames_answer(frames, name, tls.ssl_context), f"{name}: no answer over TLS frames"
        assert known[name] <= ports, (name, known[name], ports)

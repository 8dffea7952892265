"""The compiled front door (`pipeline-front`, `pipeline.router.front`) in front of an in-process router: every
RPC answered as the router's own gRPC port answers it, credentials, TLS, deadlines, cancellation, drain, and
bytes that are not the protocol."""

from __future__ import annotations

import asyncio
import os
import random
import socket

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.frames import DOOR_PARAMETER, HELLO, RESPONSE, frame
from pipeline.router import front
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.security import FRONT_ONLY_MESSAGE, UNAUTHENTICATED_MESSAGE
from pipeline.runtime.shutdown import STOPPED_MESSAGE
from pipeline.tools.testing import serving_router
from pipeline.transport import FrameServer
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.e2e.test_tls_listeners import listening_ports
from tests.integration.test_faults import SLOW_STEPS, Slow, ensemble, serve_plane
from tests.integration.test_security import certs as certs
from tests.integration.test_security import credentials, secure_serving

pytestmark = pytest.mark.skipif(front.binary() is None, reason="pipeline-front is not built (make front)")

X = np.ones((1, 2), np.float32)
COMPILED = {"front": "compiled"}


async def _answers(address: str) -> list[tuple[str, object]]:
    """What a client sees of each RPC: the reply, or the status code, message and details trailer."""
    seen: list[tuple[str, object]] = []
    async with inference_stub(address) as stub:
        calls = {
            "live": stub.ServerLive(pb.ServerLiveRequest()),
            "metadata": stub.ModelMetadata(pb.ModelMetadataRequest(name="e")),
            "config": stub.ModelConfig(pb.ModelConfigRequest(name="e")),
            "unknown metadata": stub.ModelMetadata(pb.ModelMetadataRequest(name="nope")),
            "infer": stub.ModelInfer(request_for("e", X=X), timeout=10),
            "unknown model": stub.ModelInfer(request_for("nope", X=X), timeout=10),
            "wrong datatype": stub.ModelInfer(request_for("e", X=X.astype(np.int32)), timeout=10),
            "statistics": stub.ModelStatistics(pb.ModelStatisticsRequest(name="nope")),
        }
        for name, call in calls.items():
            try:
                reply = await call
                seen.append((name, reply.SerializeToString(deterministic=True)))
            except grpc.aio.AioRpcError as err:
                details = dict(err.trailing_metadata() or ()).get("grpc-status-details-bin")
                seen.append((name, (err.code(), err.details(), details)))
    return seen


async def test_every_rpc_answers_through_the_front_as_through_the_router(tmp_path):
    server, address = await serve_plane(Slow())
    try:
        ensemble(tmp_path, address, steps=SLOW_STEPS)
        catalog = load_ensembles([tmp_path])
        async with serving_router(catalog) as python, serving_router(catalog, options=COMPILED) as compiled:
            await wait_serving(compiled.address)
            # The front listens apart from the router's own gRPC server (on loopback behind it).
            assert compiled.address != python.address
            expected, got = await _answers(python.address), await _answers(compiled.address)
            assert [name for name, _ in got] == [name for name, _ in expected]
            for (name, want), (_, have) in zip(expected, got, strict=True):
                assert have == want, name
            async with inference_stub(compiled.address) as stub:
                request = request_for("e", X=np.arange(6, dtype=np.float32).reshape(3, 2))
                request.id = "the client's id"
                reply = await stub.ModelInfer(request, timeout=10)
                assert reply.id == "the client's id"
                np.testing.assert_array_equal(
                    response_tensors(reply)["Y"].to_array(), np.arange(6).reshape(3, 2)
                )
                # The statistics count what came through the front.
                stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="e"))
                assert stats.model_stats[0].inference_count >= 2
    finally:
        await server.stop(0)


async def test_tokens_are_checked_for_each_request_through_the_front(tmp_path, monkeypatch):
    spy = Slow()
    server, address = await serve_plane(spy)
    tokens = tmp_path / "tokens"
    tokens.write_text("reader-token\n")
    monkeypatch.setenv("PIPELINE_ADMIN_TOKENS", "admin-token")
    try:
        ensemble(tmp_path, address, steps=SLOW_STEPS)
        options = {**COMPILED, "auth_tokens_file": str(tokens)}
        async with serving_router(load_ensembles([tmp_path]), options=options) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                assert (await stub.ServerLive(pb.ServerLiveRequest())).live  # open, through the front too
                for metadata in ((), (("authorization", "Bearer wrong"),)):
                    for call in (
                        stub.ModelInfer(request_for("e", X=X), metadata=metadata, timeout=5),
                        stub.ModelMetadata(pb.ModelMetadataRequest(name="e"), metadata=metadata),
                    ):
                        err = await rpc_error(call)
                        assert (err.code(), err.details()) == (
                            grpc.StatusCode.UNAUTHENTICATED,
                            UNAUTHENTICATED_MESSAGE,
                        )
                # A client's own parameter of the same name counts for nothing: the front writes the call's.
                forged = request_for("e", X=X)
                forged.parameters["authorization"].string_param = "Bearer reader-token"
                err = await rpc_error(stub.ModelInfer(forged, timeout=5))
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                assert spy.calls == 0

                reader = (("authorization", "Bearer reader-token"),)
                reply = await stub.ModelInfer(request_for("e", X=X), metadata=reader, timeout=5)
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), X)
                load = pb.RepositoryModelLoadRequest(model_name="e")
                err = await rpc_error(stub.RepositoryModelLoad(load, metadata=reader))
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED
                admin = (("authorization", "Bearer admin-token"),)
                err = await rpc_error(stub.RepositoryModelLoad(load, metadata=admin))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "is an ensemble" in err.details()
                assert spy.calls == 1
    finally:
        await server.stop(0)


async def test_mutual_tls_and_certificate_identities_through_the_front(certs, tmp_path):
    server, address = await serve_plane(Slow())
    try:
        ensemble(tmp_path, address, steps=SLOW_STEPS)
        tls = {"tls_cert": str(certs / "server.pem"), "tls_key": str(certs / "server-key.pem")}
        mutual = {**COMPILED, **tls, "tls_ca": str(certs / "ca.pem")}
        with_certificate = credentials(certs, client_cert=True)
        catalog = load_ensembles([tmp_path])
        async with serving_router(catalog, options=mutual) as router:
            await secure_serving(router.address, with_certificate)
            async with grpc.aio.secure_channel(router.address, with_certificate) as channel:
                stub = _stub(channel)
                reply = await stub.ModelInfer(request_for("e", X=X), timeout=10)
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), X)
                # Forwarded calls carry the certificate's identities: the router lets them in on it alone.
                await stub.ModelMetadata(pb.ModelMetadataRequest(name="e"), timeout=10)
            for creds in (None, credentials(certs, client_cert=False)):
                channel = (
                    grpc.aio.insecure_channel(router.address)
                    if creds is None
                    else grpc.aio.secure_channel(router.address, creds)
                )
                async with channel:
                    err = await rpc_error(_stub(channel).ModelInfer(request_for("e", X=X), timeout=5))
                    assert err.code() == grpc.StatusCode.UNAVAILABLE  # no TLS handshake without a certificate
        # Only the identities listed may infer: the client's certificate is not among them.
        listed = {**mutual, "tls_identities": frozenset({"someone-else"})}
        async with serving_router(catalog, options=listed) as router:
            await secure_serving(router.address, with_certificate)
            async with grpc.aio.secure_channel(router.address, with_certificate) as channel:
                for call in (
                    _stub(channel).ModelInfer(request_for("e", X=X), timeout=5),
                    _stub(channel).ModelMetadata(pb.ModelMetadataRequest(name="e"), timeout=5),
                ):
                    assert (await rpc_error(call)).code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)


async def test_the_routers_port_behind_the_front_answers_the_front_alone(certs, tmp_path):
    """Behind the front, the router's own gRPC port listens on loopback in plaintext: a call that is not the
    front's (without its secret) is refused there, health's too, so the front's TLS cannot be gone around."""
    server, address = await serve_plane(Slow())
    try:
        ensemble(tmp_path, address, steps=SLOW_STEPS)
        tls = {**COMPILED, "tls_cert": str(certs / "server.pem"), "tls_key": str(certs / "server-key.pem")}
        before = listening_ports(os.getpid())
        async with serving_router(load_ensembles([tmp_path]), options=tls) as router:
            creds = credentials(certs, client_cert=False)
            await secure_serving(router.address, creds)
            async with grpc.aio.secure_channel(router.address, creds) as channel:  # forwarded, and answered
                await _stub(channel).ModelMetadata(pb.ModelMetadataRequest(name="e"), timeout=10)
                reply = await _stub(channel).ModelInfer(request_for("e", X=X), timeout=10)
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), X)
            public = {int(a.rpartition(":")[2]) for a in (router.address, router.http_address) if a}
            refused = []
            for port in sorted(listening_ports(os.getpid()) - before - public):  # its gRPC port, its door
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    calls = (
                        _stub(channel).ModelInfer(request_for("e", X=X), timeout=5),
                        _stub(channel).ServerLive(pb.ServerLiveRequest(), timeout=5),
                        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5),
                    )
                    errors = [await rpc_error(call) for call in calls]
                if all(err.code() == grpc.StatusCode.UNAUTHENTICATED for err in errors):
                    assert {err.details() for err in errors} == {FRONT_ONLY_MESSAGE}
                    refused.append(port)
            assert len(refused) == 1, refused  # the router's gRPC port, found
    finally:
        await server.stop(0)


def _stub(channel: grpc.aio.Channel) -> pb_grpc.GRPCInferenceServiceStub:
    return pb_grpc.GRPCInferenceServiceStub(channel)


async def test_deadlines_and_cancellation_reach_the_router_through_the_front(tmp_path):
    spy = Slow(delay=30)
    server, address = await serve_plane(spy)
    try:
        ensemble(tmp_path, address, steps=SLOW_STEPS)
        async with serving_router(load_ensembles([tmp_path]), options=COMPILED) as router:
            await wait_serving(router.address)
            async with inference_stub(router.address) as stub:
                call = stub.ModelInfer(request_for("e", X=X))
                await _until(lambda: spy.running == 1)
                call.cancel()
                await _until(lambda: spy.running == 0)  # the router stopped the stage's call
                err = await rpc_error(stub.ModelInfer(request_for("e", X=X), timeout=0.5))
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                # The stage learnt the client's deadline, as time left.
                assert spy.timeouts[-1] is not None and 0 < spy.timeouts[-1] < 0.6  # gRPC's timeout units
                assert spy.calls == 2
    finally:
        await server.stop(0)


async def _until(condition, timeout: float = 10.0) -> None:
    """Wait for `condition` to hold, polling an event loop's turn at a time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


async def test_a_request_in_flight_is_answered_while_the_front_drains(tmp_path):
    spy = Slow(delay=0.5)
    server, address = await serve_plane(spy)
    try:
        ensemble(tmp_path, address, steps=SLOW_STEPS)
        async with serving_router(load_ensembles([tmp_path]), options=COMPILED) as router:
            await wait_serving(router.address)
            channel = grpc.aio.insecure_channel(router.address)
            call = _stub(channel).ModelInfer(request_for("e", X=X), timeout=20)
            await _until(lambda: spy.running == 1)
            router.stopping.set()
            reply = await call
            np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), X)
            await channel.close()
    finally:
        await server.stop(0)


async def test_a_request_held_past_the_grace_period_gets_the_routers_answer_through_the_front(tmp_path):
    # The stage answers long after the router's grace period: the router answers the request UNAVAILABLE at
    # its end, and the front, draining too, lets that answer through instead of cancelling the call itself.
    spy = Slow(delay=30)
    server, address = await serve_plane(spy)
    try:
        ensemble(tmp_path, address, steps=SLOW_STEPS)
        async with serving_router(load_ensembles([tmp_path]), grace=0.5, options=COMPILED) as router:
            await wait_serving(router.address)
            channel = grpc.aio.insecure_channel(router.address)
            call = _stub(channel).ModelInfer(request_for("e", X=X), timeout=20)
            await _until(lambda: spy.running == 1)
            router.stopping.set()
            error = await rpc_error(call)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert error.details() == STOPPED_MESSAGE
            await channel.close()
    finally:
        await server.stop(0)


async def test_bytes_that_are_not_the_protocol_leave_the_front_serving(tmp_path):
    server, address = await serve_plane(Slow())
    rng = random.Random(48)
    try:
        ensemble(tmp_path, address, steps=SLOW_STEPS)
        async with serving_router(load_ensembles([tmp_path]), options=COMPILED) as router:
            await wait_serving(router.address)
            host, port = router.address.rsplit(":", 1)
            preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
            garbage = [
                bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 4096))) for _ in range(20)
            ] + [preface[:10], preface + b"\x00\x00\x04\x04", preface + bytes(range(256)) * 8]
            for data in garbage:
                await asyncio.to_thread(_send_and_close, host, int(port), data)
            async with grpc.aio.insecure_channel(router.address) as channel:
                infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
                valid = request_for("e", X=X).SerializeToString()
                for cut in (1, 5, len(valid) // 2, len(valid) - 1):
                    err = await rpc_error(infer(valid[:cut], timeout=5))
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (cut, err)
                for _ in range(50):
                    noise = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 512)))
                    try:
                        await infer(noise, timeout=5)
                    except grpc.aio.AioRpcError as err:
                        assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (
                            err
                        )
                reply = await _stub(channel).ModelInfer(request_for("e", X=X), timeout=5)
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), X)
    finally:
        await server.stop(0)


def _send_and_close(host: str, port: int, data: bytes) -> None:
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(5)
        try:
            while sock.recv(4096):
                pass
        except OSError:
            pass


async def test_the_door_takes_only_the_fronts_connections():
    door = FrameServer(InferenceHandler(Slow(), "spy"), max_frame_bytes=1 << 20, door="the secret")
    await door.open(0)
    port = door.port
    try:
        for secret in (None, "", "a guess"):
            hello = pb.ModelInferRequest(id="hello")
            if secret is not None:
                hello.parameters[DOOR_PARAMETER].string_param = secret
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(frame(HELLO, hello.SerializeToString()))
            header = await reader.readexactly(5)
            answer = pb.ModelStreamInferResponse.FromString(
                await reader.readexactly(int.from_bytes(header[:4], "little"))
            )
            assert header[4] == RESPONSE and answer.error_message == UNAUTHENTICATED_MESSAGE
            assert await reader.read() == b""  # and the connection is closed
            writer.close()
    finally:
        await door.close(1)

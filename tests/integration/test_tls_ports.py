"""Every inference port under TLS checks what gRPC checks: a stage's frame port speaks the TLS of the
stage's gRPC port (client certificates and their scopes included), never plaintext, and the router reaches it
with the TLS of its channel to that stage; the router's HTTP/REST port gives a client certificate the scope
gRPC gives it."""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.protocol.frames import port_of
from pipeline.router.stages.replicas import Replicas
from pipeline.router.stages.retry import StageRetry
from pipeline.runtime.security import AccessPolicy, Scope, certificate_names, client_tls
from pipeline.tools.client import InferenceClient
from pipeline.tools.testing import serving_router, serving_stages
from pipeline.transport.frame_client import FrameConnection
from tests.conftest import request_for
from tests.integration.test_faults import ensemble
from tests.integration.test_security import certs, credentials, secure_serving
from tests.stages import Scale

__all__ = ["certs"]  # the fixture, shared with test_security

X = np.ones((1, 3), np.float32)


def server_tls(certs: Path, *, mutual: bool) -> dict[str, object]:
    """A stage's TLS flags: its certificate, and with `mutual` the CA its clients' certificates need."""
    flags: dict[str, object] = {
        "frames_port": 0,
        "tls_cert": str(certs / "server.pem"),
        "tls_key": str(certs / "server-key.pem"),
    }
    if mutual:
        flags["tls_ca"] = str(certs / "ca.pem")
    return flags


def tls_context(certs: Path, identity: str | None) -> ssl.SSLContext:
    """The router's TLS for frames: the CA, and the client certificate `identity` names (None: none)."""
    cert = key = None
    if identity is not None:
        cert, key = certs / f"{identity}.pem", certs / f"{identity}-key.pem"
    tls = client_tls(certs / "ca.pem", cert, key)
    assert tls is not None
    return tls.ssl_context


async def frame_port(address: str, creds: grpc.ChannelCredentials, token: str | None = None) -> int:
    """The frame port a TLS stage names in its `ServerMetadata`."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.secure_channel(address, creds) as channel:
        meta = await pb_grpc.GRPCInferenceServiceStub(channel).ServerMetadata(
            pb.ServerMetadataRequest(), metadata=metadata, timeout=10
        )
    port = port_of(tuple(meta.extensions))
    assert port is not None
    return port


async def infers(connection: FrameConnection) -> None:
    reply = await connection.infer(request_for("scale", X=X), 10.0, {})
    assert response_tensors(reply)["Y"].to_array().tolist() == [[2, 2, 2]]
    connection.close()


async def test_the_router_calls_a_mutual_tls_stage_over_tls_frames(certs, tmp_path, caplog):
    async with serving_stages([Scale()], options=server_tls(certs, mutual=True)) as stage:
        await secure_serving(stage.address, credentials(certs, client_cert=True))
        ensemble(tmp_path, stage.address, model="scale")
        router_options = {
            "tls_cert": str(certs / "server.pem"),
            "tls_key": str(certs / "server-key.pem"),
            "stage_tls_ca": str(certs / "ca.pem"),
            "stage_tls_cert": str(certs / "client.pem"),
            "stage_tls_key": str(certs / "client-key.pem"),
        }
        with caplog.at_level(logging.INFO, logger="pipeline.transport.server_link"):
            async with serving_router(load_ensembles([tmp_path]), options=router_options) as router:
                await secure_serving(router.address, credentials(certs, client_cert=False))
                with InferenceClient(router.address, tls_ca=certs / "ca.pem") as client:
                    for _ in range(3):
                        out = await asyncio.to_thread(client.infer, "e", {"X": X}, timeout=10)
                        np.testing.assert_array_equal(out["Y"], X * 2)
        said = [record.getMessage() for record in caplog.records]
        assert any("calls over its frame port" in line for line in said), said
        assert not any("calls over gRPC" in line for line in said), said


async def test_the_router_opens_a_frame_port_with_its_channels_tls_or_not_at_all(certs):
    """`Replicas` opens a stage's frame port with the TLS of its channels, verifying the name its gRPC channel
    verifies; where that name is not the certificate's, or the router has no TLS for the stage, it opens
    none (and does not fall back to plaintext frames)."""
    async with serving_stages([Scale()], options=server_tls(certs, mutual=True)) as stage:
        await secure_serving(stage.address, credentials(certs, client_cert=True))
        tls = client_tls(certs / "ca.pem", certs / "client.pem", certs / "client-key.pem")
        port = int(stage.address.rpartition(":")[2])

        async def resolve(host: str, port: int) -> list[str]:
            return [f"127.0.0.1:{port}"]

        for address, with_tls, takes in (
            (f"ipv4:127.0.0.1:{port}", tls, True),
            (f"stage.example:{port}", tls, False),  # not a name the stage's certificate carries
            (f"ipv4:127.0.0.1:{port}", None, False),  # a plaintext router
        ):
            replicas = Replicas(
                "s", address, max_message_bytes=1 << 26, retry=StageRetry(), tls=with_tls, resolve=resolve
            )
            try:
                await replicas.settle()
                (replica,) = replicas.by_address.values()
                connection = await replica.link.frame_connection()
                assert (connection is not None) is takes, address
                assert (replica.link.transport == "frames") is takes, address
                if connection is not None:
                    await infers(connection)
            finally:
                await replicas.close()


async def test_a_tls_frame_port_takes_no_plaintext_and_checks_the_server_name(certs, tmp_path):
    (tmp_path / "users").write_text("user-token\n")
    options = {**server_tls(certs, mutual=False), "auth_tokens_file": str(tmp_path / "users")}
    token = (("authorization", "Bearer user-token"),)
    async with serving_stages([Scale()], options=options) as stage:
        creds = credentials(certs, client_cert=False)
        await secure_serving(stage.address, creds)
        port = await frame_port(stage.address, creds, "user-token")
        # Plaintext: the TLS port reads the hello as a broken handshake and closes the connection.
        with pytest.raises(ConnectionError, match="did not answer its hello"):
            await FrameConnection.open("127.0.0.1", port, token, 1 << 26)
        # TLS verifies the stage as gRPC does: a name its certificate does not carry is refused.
        with pytest.raises(ssl.SSLCertVerificationError):
            await FrameConnection.open(
                "127.0.0.1", port, token, 1 << 26, tls=tls_context(certs, None), server_name="elsewhere"
            )
        # Over TLS the token is checked as on gRPC.
        with pytest.raises(ConnectionError, match="refused its hello: missing or invalid credentials"):
            await FrameConnection.open("127.0.0.1", port, (), 1 << 26, tls=tls_context(certs, None))
        connection = await FrameConnection.open(
            "127.0.0.1", port, token, 1 << 26, tls=tls_context(certs, None), server_name="localhost"
        )
        await infers(connection)


async def test_a_mutual_tls_frame_port_gives_a_certificate_the_scope_grpc_gives_it(certs):
    """Only certificates of the CA connect; of those, one whose identity `--tls-identities` does not list is
    refused at its hello, as gRPC refuses its calls; an admin identity may infer."""
    options = {
        **server_tls(certs, mutual=True),
        "tls_identities": frozenset({"pipeline-router"}),
        "tls_admin_identities": frozenset({"pipeline-admin"}),
    }
    async with serving_stages([Scale()], options=options) as stage:
        admin = grpc.ssl_channel_credentials(
            (certs / "ca.pem").read_bytes(),
            (certs / "admin-key.pem").read_bytes(),
            (certs / "admin.pem").read_bytes(),
        )
        await secure_serving(stage.address, admin)
        port = await frame_port(stage.address, admin)
        # No client certificate: the TLS handshake itself is refused.
        with pytest.raises(OSError):
            await FrameConnection.open("127.0.0.1", port, (), 1 << 26, tls=tls_context(certs, None))
        # A certificate of the CA without the scope: refused, as gRPC refuses its ModelInfer.
        client = tls_context(certs, "client")
        with pytest.raises(ConnectionError, match="refused its hello: missing or invalid credentials"):
            await FrameConnection.open("127.0.0.1", port, (), 1 << 26, tls=client)
        async with grpc.aio.secure_channel(stage.address, credentials(certs, client_cert=True)) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(request_for("scale", X=X), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        connection = await FrameConnection.open(
            "127.0.0.1", port, (), 1 << 26, tls=tls_context(certs, "admin")
        )
        await infers(connection)


def test_certificate_names_are_the_identities_grpc_lists():
    """`ssl`'s view of a certificate gives the names gRPC's auth context gives: CN and every SAN, IPv6
    addresses written short, as gRPC writes them."""
    peer = {
        "subject": ((("organizationName", "x"),), (("commonName", "pipeline-admin"),)),
        "subjectAltName": (
            ("DNS", "ops.example"),
            ("IP Address", "127.0.0.1"),
            ("IP Address", "0:0:0:0:0:0:0:1\n"),
            ("URI", "spiffe://example/ops"),
        ),
    }
    names = certificate_names(peer)
    assert names == {"pipeline-admin", "ops.example", "127.0.0.1", "::1", "spiffe://example/ops"}
    assert certificate_names(None) == frozenset() == certificate_names({})
    policy = AccessPolicy(client_certificates=True, admin_identities=frozenset({"ops.example"}))
    assert policy.scope((), names) == Scope.ADMIN
    assert policy.scope((), ()) is None


async def test_the_routers_http_port_gives_a_client_certificate_the_scope_grpc_gives_it(certs, tmp_path):
    """With client certificates required, `--tls-identities` and `--tls-admin-identities` hold on HTTP/REST
    as on gRPC: an unlisted certificate is refused, an admin one may load models."""
    async with serving_stages([Scale()]) as stage:
        ensemble(tmp_path, stage.address, model="scale")
        options = {
            "tls_cert": str(certs / "server.pem"),
            "tls_key": str(certs / "server-key.pem"),
            "tls_ca": str(certs / "ca.pem"),
            "tls_identities": frozenset({"pipeline-router"}),
            "tls_admin_identities": frozenset({"pipeline-admin"}),
        }
        async with serving_router(load_ensembles([tmp_path]), options=options) as router:
            admin = grpc.ssl_channel_credentials(
                (certs / "ca.pem").read_bytes(),
                (certs / "admin-key.pem").read_bytes(),
                (certs / "admin.pem").read_bytes(),
            )
            await secure_serving(router.address, admin)
            body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [1, 1, 1]}]}
            base = f"https://{router.http_address}/v2"
            answers = {}
            for identity in ("client", "admin"):
                connector = aiohttp.TCPConnector(ssl=tls_context(certs, identity))
                async with aiohttp.ClientSession(connector=connector) as http:
                    async with http.post(f"{base}/models/e/infer", json=body) as reply:
                        answers[identity, "infer"] = reply.status, await reply.json()
                    async with http.get(f"{base}/health/ready") as reply:
                        answers[identity, "ready"] = reply.status, None
                    async with http.post(f"{base}/repository/models/e/load") as reply:
                        answers[identity, "load"] = reply.status, None
            assert answers["client", "infer"][0] == 401
            assert answers["client", "ready"][0] == 200  # probes stay open
            assert answers["client", "load"][0] == 401
            assert answers["admin", "infer"][0] == 200
            assert answers["admin", "infer"][1]["outputs"][0]["data"] == [2, 2, 2]
            # An admin passes the checks: the router then refuses to load an ensemble (it follows its models).
            assert answers["admin", "load"][0] == 400, answers
            # gRPC says the same of the unlisted certificate.
            async with grpc.aio.secure_channel(
                router.address, credentials(certs, client_cert=True)
            ) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ModelInfer(request_for("e", X=X), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_pipeline_bench_loads_a_tls_router(certs, tmp_path, protocol):
    from pipeline.tools.bench.options import BenchOptions
    from pipeline.tools.bench.run import run_bench

    async with serving_stages([Scale()]) as stage:
        ensemble(tmp_path, stage.address, model="scale")
        options = {"tls_cert": str(certs / "server.pem"), "tls_key": str(certs / "server-key.pem")}
        async with serving_router(load_ensembles([tmp_path]), options=options) as router:
            await secure_serving(router.address, credentials(certs, client_cert=False))
            url = router.address if protocol == "grpc" else router.http_address
            assert url is not None
            bench = BenchOptions(
                url=url,
                model="e",
                protocol=protocol,
                shapes={"X": (3,)},
                values={"X": "1"},  # the stage refuses negative values
                warmup=0.2,
                duration=0.5,
                progress=False,
                tls_ca=str(certs / "ca.pem"),
            )
            result = (await run_bench(bench)).results[0]
            assert result.ok == result.sent > 0 and not result.errors

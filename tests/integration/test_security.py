"""Security over real gRPC: TLS and mutual TLS on every hop, bearer tokens and the admin scope at the router,
no unsafe deserialisation in the source tree, and model repository names confined to the repository."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.client import InferenceClient
from pipeline.config import load_ensembles
from pipeline.convert import response_tensors
from pipeline.security import UNAUTHENTICATED_MESSAGE, Scope, SecurityConfigError, TokenAuthenticator
from pipeline.server import server_options
from pipeline.testing import serving_router, serving_stages
from tests.conftest import inference_stub, request_for, rpc_error, wait_serving
from tests.integration.test_faults import Hold, Slow, ensemble, serve_plane

REPO = Path(__file__).resolve().parents[2]
X = np.ones((1, 2), np.float32)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("certs")
    subprocess.run(
        ["sh", str(REPO / "scripts" / "make-certs.sh"), str(folder)], check=True, capture_output=True
    )
    return folder


def credentials(certs: Path, *, client_cert: bool) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        (certs / "ca.pem").read_bytes(),
        (certs / "client-key.pem").read_bytes() if client_cert else None,
        (certs / "client.pem").read_bytes() if client_cert else None,
    )


async def call_fails(address: str, creds: grpc.ChannelCredentials | None) -> grpc.StatusCode | None:
    """The status of a ServerLive call over a channel with `creds` (None: plaintext); None if it worked."""
    channel = grpc.aio.insecure_channel(address) if creds is None else grpc.aio.secure_channel(address, creds)
    async with channel:
        try:
            await pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=5)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return None


async def secure_serving(address: str, creds: grpc.ChannelCredentials) -> None:
    async with grpc.aio.secure_channel(address, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(200):
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(address)


async def test_tls_on_every_hop_with_mutual_tls(certs, tmp_path):
    server = {"tls_cert": str(certs / "server.pem"), "tls_key": str(certs / "server-key.pem")}
    mutual = {**server, "tls_ca": str(certs / "ca.pem")}
    with_client_cert = credentials(certs, client_cert=True)
    async with serving_stages([Hold()], options=mutual) as a, serving_stages([Hold()], options=mutual) as b:
        await secure_serving(a.address, with_client_cert)
        await secure_serving(b.address, with_client_cert)
        # A stage takes no plaintext and no TLS client without a certificate from the CA.
        assert await call_fails(a.address, None) is not None
        assert await call_fails(a.address, credentials(certs, client_cert=False)) is not None
        assert await call_fails(a.address, with_client_cert) is None

        ensemble(tmp_path, f"ipv4:{a.address},{b.address}", model="hold")
        router_options = {
            **mutual,
            "stage_tls_ca": str(certs / "ca.pem"),
            "stage_tls_cert": str(certs / "client.pem"),
            "stage_tls_key": str(certs / "client-key.pem"),
        }
        async with serving_router(load_ensembles([tmp_path]), options=router_options) as router:
            await secure_serving(router.address, with_client_cert)
            assert await call_fails(router.address, None) is not None
            assert await call_fails(router.address, credentials(certs, client_cert=False)) is not None
            client = InferenceClient(
                router.address,
                tls_ca=certs / "ca.pem",
                tls_cert=certs / "client.pem",
                tls_key=certs / "client-key.pem",
            )
            with client:
                for _ in range(4):  # both replicas, over TLS
                    out = await asyncio.to_thread(client.infer, "e", {"X": X}, timeout=10)
                    np.testing.assert_array_equal(out["Y"], X)


async def test_tls_without_client_certificates(certs, tmp_path):
    server = {"tls_cert": str(certs / "server.pem"), "tls_key": str(certs / "server-key.pem")}
    async with serving_stages([Hold()], options=server) as stage:
        ensemble(tmp_path, stage.address, model="hold")
        options = {**server, "stage_tls_ca": str(certs / "ca.pem")}
        async with serving_router(load_ensembles([tmp_path]), options=options) as router:
            await secure_serving(router.address, credentials(certs, client_cert=False))
            with InferenceClient(router.address, tls_ca=certs / "ca.pem") as client:
                out = await asyncio.to_thread(client.infer, "e", {"X": X}, timeout=10)
            np.testing.assert_array_equal(out["Y"], X)


def test_bad_tls_settings_are_refused_with_what_is_wrong(tmp_path):
    from pipeline.security import channel_credentials, server_credentials

    assert server_credentials(None, None, None) is None  # plaintext
    (tmp_path / "cert.pem").write_text("x")
    with pytest.raises(SecurityConfigError, match="both --tls-cert and --tls-key"):
        server_credentials(tmp_path / "cert.pem", None)
    with pytest.raises(SecurityConfigError, match="--tls-ca"):
        (tmp_path / "ca.pem").write_text("x")
        server_credentials(None, None, tmp_path / "ca.pem")
    with pytest.raises(SecurityConfigError, match="cannot read the TLS CA"):
        channel_credentials(tmp_path / "missing.pem")


# --- authentication ------------------------------------------------------------------------------------


def test_token_scopes_and_malformed_headers():
    auth = TokenAuthenticator(["reader-token"], ["admin-token"])
    assert auth.scope_of([("authorization", "Bearer reader-token")]) == Scope.INFER
    assert auth.scope_of([("authorization", "bearer admin-token")]) == Scope.ADMIN
    for wrong in (
        "Bearer reader",
        "Basic reader-token",
        "reader-token",
        "Bearer ",
        "",
        "Bearer admin-token2",
    ):
        assert auth.scope_of([("authorization", wrong)]) is None, wrong
    assert auth.scope_of([]) is None
    with pytest.raises(SecurityConfigError):
        TokenAuthenticator([], [])


async def test_bearer_tokens_at_the_router(tmp_path, monkeypatch):
    spy = Slow()
    server, address = await serve_plane(spy)
    tokens = tmp_path / "tokens"
    tokens.write_text("# readers\nreader-token\n\n")
    monkeypatch.setenv("PIPELINE_ADMIN_TOKENS", "admin-token")
    try:
        ensemble(
            tmp_path,
            address,
            steps="  - {model_name: slow, stage: s, input_map: {X: X}, output_map: {X: Y}}\n",
        )
        catalog = load_ensembles([tmp_path])
        async with serving_router(catalog, options={"auth_tokens_file": str(tokens)}) as router:
            await wait_serving(router.address)  # health is open
            async with inference_stub(router.address) as stub:
                # Liveness and readiness are open too.
                assert (await stub.ServerLive(pb.ServerLiveRequest())).live
                assert (await stub.ServerReady(pb.ServerReadyRequest())).ready

                messages = set()
                for metadata in (
                    (),
                    (("authorization", "Bearer wrong"),),
                    (("authorization", "reader-token"),),
                ):
                    err = await rpc_error(
                        stub.ModelInfer(request_for("e", X=X), metadata=metadata, timeout=5)
                    )
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                    messages.add(err.details())
                    err = await rpc_error(
                        stub.ModelMetadata(pb.ModelMetadataRequest(name="e"), metadata=metadata)
                    )
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                assert messages == {UNAUTHENTICATED_MESSAGE}  # nothing says which part was wrong
                assert spy.calls == 0

                reader = (("authorization", "Bearer reader-token"),)
                admin = (("authorization", "Bearer admin-token"),)
                reply = await stub.ModelInfer(request_for("e", X=X), metadata=reader, timeout=5)
                np.testing.assert_array_equal(response_tensors(reply)["Y"].to_array(), X)
                await stub.ModelInfer(request_for("e", X=X), metadata=admin, timeout=5)
                # The token is the router's to check: it does not travel on to the stages.
                assert spy.calls == 2

                # A stream is checked too.
                async def one():
                    yield request_for("e", X=X)

                err = await rpc_error(stub.ModelStreamInfer(one()).read())
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED

                load = pb.RepositoryModelLoadRequest(model_name="e")
                err = await rpc_error(stub.RepositoryModelLoad(load, metadata=reader))
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED
                err = await rpc_error(
                    stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(), metadata=())
                )
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                # An admin passes; the router itself has no repository to load into.
                err = await rpc_error(stub.RepositoryModelLoad(load, metadata=admin))
                assert err.code() == grpc.StatusCode.UNIMPLEMENTED

            with InferenceClient(router.address, token="reader-token") as client:
                out = await asyncio.to_thread(client.infer, "e", {"X": X}, timeout=5)
            np.testing.assert_array_equal(out["Y"], X)
    finally:
        await server.stop(0)


async def test_the_stages_never_see_the_clients_token(tmp_path):
    spy = Slow()
    server, address = await serve_plane(spy)
    try:
        ensemble(
            tmp_path,
            address,
            steps="  - {model_name: slow, stage: s, input_map: {X: X}, output_map: {X: Y}}\n",
        )
        async with serving_router(load_ensembles([tmp_path])) as router:
            await wait_serving(router.address)
            async with grpc.aio.insecure_channel(router.address, options=server_options(1 << 20)) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                seen = []
                original = spy.infer

                async def record(request, call):
                    seen.extend(key for key, _ in call.metadata)
                    return await original(request, call)

                spy.infer = record  # type: ignore[method-assign]
                metadata = (("authorization", "Bearer secret"), ("x-trace-me", "1"))
                await stub.ModelInfer(request_for("e", X=X), metadata=metadata, timeout=5)
            assert "x-trace-me" in seen and "authorization" not in seen
    finally:
        await server.stop(0)


# --- no unsafe deserialisation -------------------------------------------------------------------------

UNSAFE = [
    (re.compile(r"\bimport\s+(c?pickle|dill|shelve|marshal)\b|\bfrom\s+(c?pickle|dill|shelve)\b"), "pickle"),
    (re.compile(r"\bpickle\.loads?\("), "pickle"),
    (re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
    (
        re.compile(r"yaml\.load\((?![^)]*Loader\s*=\s*\w*Safe\w*Loader|[^)]*Loader\s*=\s*_StrictLoader)"),
        "yaml.load",
    ),
    (
        re.compile(r"yaml\.unsafe_load|yaml\.full_load|Loader\s*=\s*yaml\.(Unsafe|Full)?Loader\b"),
        "unsafe YAML",
    ),
    (re.compile(r"shell\s*=\s*True"), "shell=True"),
    (re.compile(r"\bos\.system\("), "os.system"),
    (re.compile(r"(?<![.\w])(?<!def )(eval|exec)\("), "eval/exec"),
    (re.compile(r"allow_pickle\s*=\s*(?!False\b)"), "numpy allow_pickle that is not literally False"),
    (re.compile(r"\bpickle\.(load|Unpickler)\b|\bcloudpickle\b|\bjoblib\.load\("), "pickle"),
]


#: Deliberate code execution, each with its reason: (file, the matched text).
ALLOWED = {
    # The python backend runs a repository's model.py: serving user code is its purpose, the folder must be
    # trusted (README), and paths are confined to it.
    ("pipeline/python_backend.py", "exec("),
}


def test_no_unsafe_deserialisation_in_the_source_tree():
    this = Path(__file__).resolve()
    found = []
    for folder in ("pipeline", "services", "scripts", "examples", "tests", "bench", "model_repository"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.resolve() == this or "_gen" in path.parts:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            # One call may span lines: join them so that its keyword arguments are seen.
            flat = re.sub(r"\(\s*\n\s*", "(", text)
            flat = re.sub(r",\s*\n\s*", ", ", flat)
            for pattern, what in UNSAFE:
                for match in pattern.finditer(flat):
                    if (str(path.relative_to(REPO)), match.group(0)) not in ALLOWED:
                        found.append(f"{path.relative_to(REPO)}: {what}: {match.group(0)!r}")
    assert not found, "\n".join(found)


# --- model repository names stay inside the repository -------------------------------------------------


async def test_repository_model_load_cannot_leave_the_repository(tmp_path):
    from tests.integration.test_model_service import serving
    from tests.model_files import add_model

    root = tmp_path / "models"
    add_model(root, "onnx", "good", {"1": 1})
    outside = add_model(tmp_path / "outside", "onnx", "evil", {"1": 1})
    async with serving(root) as stub:
        for name in ("../outside/evil", str(outside), "good/../../outside/evil"):
            err = await rpc_error(stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=name)))
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), name
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
        assert all("evil" not in model.name for model in index.models)

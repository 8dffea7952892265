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
from pipeline.ensemble.catalog import load_ensembles
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.security import UNAUTHENTICATED_MESSAGE, Scope, SecurityConfigError, TokenAuthenticator
from pipeline.runtime.server import server_options
from pipeline.tools.client import InferenceClient
from pipeline.tools.testing import serving_router, serving_stages
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
    from pipeline.runtime.security import channel_credentials, server_credentials

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
                # An admin passes, and learns that an ensemble is not loaded through the repository API.
                err = await rpc_error(stub.RepositoryModelLoad(load, metadata=admin))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "is an ensemble" in err.details()

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
        re.compile(r"yaml\.load\((?![^)]*Loader\s*=\s*\w*Safe\w*Loader|[^)]*Loader\s*=\s*_?StrictLoader)"),
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


#: Where a pattern is the feature itself: (path, what) -> why.
ALLOWED = {
    (
        "pipeline/stage/model_file.py",
        "eval/exec",
    ): "runs a repository's model.py, as Triton's Python backend "
    "does: the repository must be trusted (docs/serving/python-stages.md)",
    (
        "tests/unit/test_docs_site.py",
        "yaml.load",
    ): "a yaml.SafeLoader subclass that reads mkdocs.yml's python tags as nothing",
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
                if (path.relative_to(REPO).as_posix(), what) in ALLOWED:
                    continue
                for match in pattern.finditer(flat):
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


# --- authentication on every service: the stage services, and the router reaching them ------------------


def _add_sub_repository(root: Path) -> Path:
    from tests.stages import TRITON_ADD_SUB_CONFIG, TRITON_ADD_SUB_MODEL, write_model

    write_model(root, "add_sub", TRITON_ADD_SUB_MODEL, TRITON_ADD_SUB_CONFIG)
    return root


def _serving_repository(root: Path, options: dict):
    from pipeline.runtime.repository import ModelRepository
    from pipeline.stage.python_backend import PythonBackend

    return serving_stages([], repository=ModelRepository(root), backends=[PythonBackend()], options=options)


def _add_sub_request() -> pb.ModelInferRequest:
    ones = np.ones(4, np.float32)
    return request_for("add_sub", INPUT0=ones, INPUT1=ones)


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def test_tokens_on_a_stage_service(tmp_path):
    """No token, a user token, an admin token: what each may do on a stage service."""
    (tmp_path / "users").write_text("user-token\n")
    (tmp_path / "admins").write_text("admin-token\n")
    options = {"auth_tokens_file": str(tmp_path / "users"), "admin_tokens_file": str(tmp_path / "admins")}
    async with _serving_repository(_add_sub_repository(tmp_path / "models"), options) as stage:
        await wait_serving(stage.address)  # health is open
        async with inference_stub(stage.address) as stub:
            assert (await stub.ServerLive(pb.ServerLiveRequest())).live
            assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
            load = pb.RepositoryModelLoadRequest(model_name="add_sub")
            unload = pb.RepositoryModelUnloadRequest(model_name="add_sub")
            for metadata in ((), _bearer("wrong"), (("authorization", "user-token"),)):
                for call in (
                    stub.ModelInfer(_add_sub_request(), metadata=metadata),
                    stub.ModelMetadata(pb.ModelMetadataRequest(name="add_sub"), metadata=metadata),
                    stub.ModelConfig(pb.ModelConfigRequest(name="add_sub"), metadata=metadata),
                    stub.ModelReady(pb.ModelReadyRequest(name="add_sub"), metadata=metadata),
                    stub.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=metadata),
                    stub.RepositoryModelLoad(load, metadata=metadata),
                    stub.RepositoryModelUnload(unload, metadata=metadata),
                ):
                    err = await rpc_error(call)
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert err.details() == UNAUTHENTICATED_MESSAGE

            user = _bearer("user-token")
            reply = await stub.ModelInfer(_add_sub_request(), metadata=user)
            np.testing.assert_array_equal(response_tensors(reply)["OUTPUT0"].to_array(), np.full(4, 2.0))
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="add_sub"), metadata=user)).ready
            for call in (
                stub.RepositoryModelLoad(load, metadata=user),
                stub.RepositoryModelUnload(unload, metadata=user),
            ):
                err = await rpc_error(call)
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "needs an admin token" in err.details()
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="add_sub"), metadata=user)).ready

            admin = _bearer("admin-token")
            await stub.RepositoryModelUnload(unload, metadata=admin)
            assert not (await stub.ModelReady(pb.ModelReadyRequest(name="add_sub"), metadata=user)).ready
            await stub.RepositoryModelLoad(load, metadata=admin)
            reply = await stub.ModelInfer(_add_sub_request(), metadata=admin)
            np.testing.assert_array_equal(response_tensors(reply)["OUTPUT1"].to_array(), np.zeros(4))


async def test_the_router_reaches_token_protected_stages_with_a_token_of_its_own(tmp_path):
    (tmp_path / "stage-users").write_text("stage-user\n")
    (tmp_path / "router-users").write_text("client-token\n")
    stage_options = {"auth_tokens_file": str(tmp_path / "stage-users"), "stage_token": "router-secret"}
    async with _serving_repository(_add_sub_repository(tmp_path / "models"), stage_options) as stage:
        folder = tmp_path / "ensembles"
        folder.mkdir()
        (folder / "e.yaml").write_text(
            f"""
name: e
max_batch_size: 0
stages: {{s: {{address: "{stage.address}"}}}}
inputs: [{{name: A, datatype: FP32, shape: [4]}}, {{name: B, datatype: FP32, shape: [4]}}]
outputs: [{{name: SUM, datatype: FP32, shape: [4]}}]
steps:
  - {{model_name: add_sub, stage: s, input_map: {{INPUT0: A, INPUT1: B}}, output_map: {{OUTPUT0: SUM}}}}
"""
        )
        catalog = load_ensembles([folder])
        router_options = {"auth_tokens_file": str(tmp_path / "router-users"), "stage_token": "router-secret"}
        async with serving_router(catalog, options=router_options) as router:
            await wait_serving(router.address)  # it learnt the stage's signature with its own token
            ones = np.ones(4, np.float32)
            async with inference_stub(router.address) as stub:
                client = _bearer("client-token")
                reply = await stub.ModelInfer(request_for("e", A=ones, B=ones), metadata=client, timeout=10)
                np.testing.assert_array_equal(response_tensors(reply)["SUM"].to_array(), np.full(4, 2.0))
                # A stage model called through the router: forwarded with the router's token.
                reply = await stub.ModelInfer(_add_sub_request(), metadata=client, timeout=10)
                assert "OUTPUT0" in response_tensors(reply)
                # Each server has its own tokens: the router takes neither the stage's nor its own stage token.
                for token in ("stage-user", "router-secret"):
                    err = await rpc_error(
                        stub.ModelInfer(request_for("e", A=ones, B=ones), metadata=_bearer(token))
                    )
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            async with inference_stub(stage.address) as stub:
                # The router's token infers on the stage, but is no admin token there.
                await stub.ModelInfer(_add_sub_request(), metadata=_bearer("router-secret"))
                load = pb.RepositoryModelLoadRequest(model_name="add_sub")
                err = await rpc_error(stub.RepositoryModelLoad(load, metadata=_bearer("router-secret")))
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED

        # A router without the stage token is refused by the stage, and says so.
        async with serving_router(catalog) as router, inference_stub(router.address) as stub:
            err = await rpc_error(stub.ModelMetadata(pb.ModelMetadataRequest(name="add_sub"), timeout=10))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "stage 's'" in err.details() and UNAUTHENTICATED_MESSAGE in err.details()
            assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready


def test_certificate_identities_map_to_scopes():
    from pipeline.runtime.security import AccessPolicy

    policy = AccessPolicy(client_certificates=True, admin_identities=frozenset({"ops"}))
    assert policy.certificate_scope({"x509_common_name": [b"anyone"]}) == Scope.INFER
    assert policy.certificate_scope({"x509_subject_alternative_name": [b"x", b"ops"]}) == Scope.ADMIN
    assert policy.certificate_scope({}) is None  # no verified certificate
    listed = AccessPolicy(client_certificates=True, identities=frozenset({"router"}))
    assert listed.certificate_scope({"x509_common_name": [b"router"]}) == Scope.INFER
    assert listed.certificate_scope({"x509_common_name": [b"someone-else"]}) is None
    assert AccessPolicy().certificate_scope({"x509_common_name": [b"ops"]}) is None  # no mutual TLS


async def test_client_certificate_identities_on_a_stage_service(certs, tmp_path):
    """Mutual TLS: any certificate of the CA infers; the one `--tls-admin-identities` names loads models."""
    mutual = {
        "tls_cert": str(certs / "server.pem"),
        "tls_key": str(certs / "server-key.pem"),
        "tls_ca": str(certs / "ca.pem"),
        "tls_admin_identities": frozenset({"pipeline-admin"}),
    }
    ca = (certs / "ca.pem").read_bytes()

    def channel(address: str, name: str) -> grpc.aio.Channel:
        key, cert = (certs / f"{name}-key.pem").read_bytes(), (certs / f"{name}.pem").read_bytes()
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert))

    load = pb.RepositoryModelLoadRequest(model_name="add_sub")
    async with _serving_repository(_add_sub_repository(tmp_path / "models"), mutual) as stage:
        async with channel(stage.address, "client") as client_channel:
            await secure_serving(stage.address, credentials(certs, client_cert=True))
            stub = pb_grpc.GRPCInferenceServiceStub(client_channel)
            reply = await stub.ModelInfer(_add_sub_request(), timeout=10)
            assert "OUTPUT0" in response_tensors(reply)
            err = await rpc_error(stub.RepositoryModelLoad(load, timeout=10))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        async with channel(stage.address, "admin") as admin_channel:
            stub = pb_grpc.GRPCInferenceServiceStub(admin_channel)
            await stub.RepositoryModelLoad(load, timeout=30)
            await stub.ModelInfer(_add_sub_request(), timeout=10)

    only_router = {**mutual, "tls_identities": frozenset({"pipeline-router"})}
    async with _serving_repository(_add_sub_repository(tmp_path / "models"), only_router) as stage:
        await secure_serving(stage.address, credentials(certs, client_cert=True))
        async with channel(stage.address, "client") as client_channel:
            stub = pb_grpc.GRPCInferenceServiceStub(client_channel)
            err = await rpc_error(stub.ModelInfer(_add_sub_request(), timeout=10))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (await stub.ServerReady(pb.ServerReadyRequest(), timeout=10)).ready  # probes stay open

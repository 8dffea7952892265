"""TLS on every hop and optional per-request authentication.

TLS: every server takes `--tls-cert`/`--tls-key` (PEM files; the server then listens with TLS only, on
every port that takes inference: gRPC, HTTP/REST and a stage's frame port) and `--tls-ca` (clients must then
present a certificate signed by it: mutual TLS). The router's calls of its stages use
`--stage-tls-ca`/`--stage-tls-cert`/`--stage-tls-key` (env `PIPELINE_STAGE_TLS_*`), on gRPC and frames
alike (`ClientTls`), and clients (`InferenceClient`, `pipeline infer`) take the same three files.

Authentication (every server, router and stages alike): bearer tokens, `authorization: Bearer <token>` in
the call's metadata, checked per request against a set of tokens (file or environment) in constant time,
and, with mutual TLS, the client certificate. Two scopes: `infer` (every RPC but the management ones) and
`admin` (everything, including `RepositoryModelLoad`/`Unload`). A certificate the server's CA signed has the
infer scope (or none, where `--tls-identities` lists the identities allowed and its own is not among them);
one whose identity (subject CN or a subject alternative name) `--tls-admin-identities` lists has the admin
scope. A call has the higher of its token's and its certificate's scopes. Health stays open:
`grpc.health.v1.Health` and `ServerLive`/`ServerReady` never ask for credentials, so probes need none.
A refused call learns only that its credentials were missing or wrong (UNAUTHENTICATED), never which part;
valid credentials without the scope get PERMISSION_DENIED.

The router calls its stages with a token of its own (`--stage-token`, env `PIPELINE_STAGE_TOKEN`), which a
stage service given the same setting accepts with the infer scope, or with its client certificate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from enum import IntEnum
from pathlib import Path
from typing import Any, TypeVar

import grpc

from pipeline.runtime.call_abort import abort
from pipeline.runtime.server_settings import RouterToken, Security, StageToken

log = logging.getLogger(__name__)

_INFERENCE = "/inference.GRPCInferenceService/"

#: RPCs anyone may call: liveness and readiness probes must work without credentials.
OPEN_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        _INFERENCE + "ServerLive",
        _INFERENCE + "ServerReady",
    }
)

#: Metadata the router's compiled front adds to a call it forwards (`pipeline.router.front`): the door's
#: secret, and the identities of the client's verified certificate (an entry each), which the router's gRPC
#: port, on loopback behind the front, cannot see itself. Never passed on to a stage.
DOOR_HEADER = "pipeline-door"
IDENTITIES_HEADER = "pipeline-peer-identities"

#: Management RPCs: they change what is served, so they need the admin scope.
ADMIN_METHODS = frozenset({_INFERENCE + "RepositoryModelLoad", _INFERENCE + "RepositoryModelUnload"})


class SecurityConfigError(ValueError):
    """TLS files or token sources are missing, unreadable or inconsistent; the message says which."""


# --- TLS -----------------------------------------------------------------------------------------------


def _read(path: str | os.PathLike[str] | None, what: str) -> bytes | None:
    if path is None or str(path) == "":
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise SecurityConfigError(f"cannot read the {what} '{path}': {err.strerror or err}") from None


def server_credentials(
    cert: str | os.PathLike[str] | None,
    key: str | os.PathLike[str] | None,
    ca: str | os.PathLike[str] | None = None,
) -> grpc.ServerCredentials | None:
    """TLS server credentials from PEM files, or None (plaintext) when no certificate is given.

    With `ca` the server requires every client to present a certificate signed by it (mutual TLS).
    """
    cert_pem, key_pem, ca_pem = _read(cert, "TLS certificate"), _read(key, "TLS key"), _read(ca, "TLS CA")
    if cert_pem is None and key_pem is None:
        if ca_pem is not None:
            raise SecurityConfigError("--tls-ca (client certificates) needs --tls-cert and --tls-key too")
        return None
    if cert_pem is None or key_pem is None:
        raise SecurityConfigError("TLS needs both --tls-cert and --tls-key")
    return grpc.ssl_server_credentials(
        [(key_pem, cert_pem)], root_certificates=ca_pem, require_client_auth=ca_pem is not None
    )


@dataclasses.dataclass(frozen=True)
class ClientTls:
    """A client's TLS, made once from its PEM files: the same roots and client certificate for a gRPC channel
    and for an asyncio stream (a stage's frame port), so that both verify a server alike."""

    credentials: grpc.ChannelCredentials
    #: For `loop.create_connection(..., ssl=ssl_context, server_hostname=...)`.
    ssl_context: ssl.SSLContext


def client_tls(
    ca: str | os.PathLike[str] | None,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
) -> ClientTls | None:
    """A client's TLS from PEM files (the CA to trust; a client certificate for mutual TLS), or None
    (plaintext) when none is given."""
    ca_pem = _read(ca, "TLS CA")
    cert_pem, key_pem = _read(cert, "TLS certificate"), _read(key, "TLS key")
    if ca_pem is None and cert_pem is None and key_pem is None:
        return None
    if (cert_pem is None) != (key_pem is None):
        raise SecurityConfigError("a client certificate needs both its certificate and its key")
    # NOTE: without a CA the system's trust store is used (a server with a public certificate), on both.
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem
    )
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    try:
        if ca_pem is not None:
            context.load_verify_locations(cadata=ca_pem.decode("ascii"))
        if cert_pem is not None:
            context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError, UnicodeDecodeError, ValueError) as err:
        raise SecurityConfigError(f"cannot use the TLS files {ca}, {cert}, {key}: {err}") from None
    return ClientTls(credentials, context)


def channel_credentials(
    ca: str | os.PathLike[str] | None,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
) -> grpc.ChannelCredentials | None:
    """The gRPC channel credentials of `client_tls`, or None (plaintext) when no file is given."""
    tls = client_tls(ca, cert, key)
    return None if tls is None else tls.credentials


def server_credentials_of(security: Security) -> grpc.ServerCredentials | None:
    """The server credentials that a server's settings ask for (None: plaintext)."""
    return server_credentials(security.tls_cert, security.tls_key, security.tls_ca)


def server_ssl_context(
    cert: str | os.PathLike[str] | None,
    key: str | os.PathLike[str] | None,
    ca: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext | None:
    """The same TLS as `server_credentials`, for an HTTP server: None (plaintext) when no certificate is
    given; with `ca`, clients must present a certificate signed by it (mutual TLS)."""
    if server_credentials(cert, key, ca) is None:  # the same checks and messages as the gRPC side
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(cert), str(key))
        if ca:
            context.load_verify_locations(str(ca))
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as err:
        raise SecurityConfigError(f"cannot use the TLS certificate '{cert}' and key '{key}': {err}") from None
    return context


def server_ssl_context_of(security: Security) -> ssl.SSLContext | None:
    """The TLS context that a server's settings ask for (None: plaintext)."""
    return server_ssl_context(security.tls_cert, security.tls_key, security.tls_ca)


# --- authentication ------------------------------------------------------------------------------------


class Scope(IntEnum):
    """What a token may do; a higher scope includes the lower."""

    INFER = 1
    ADMIN = 2


def _digest(token: str | bytes) -> bytes:
    data = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(data).digest()


def read_tokens(path: str | os.PathLike[str] | None, listed: str | None = None) -> list[str]:
    """Tokens from a file (one a line; blank lines and `#` comments skipped) and a comma-separated list."""
    tokens: list[str] = []
    text = _read(path, "tokens file")
    if text is not None:
        for line in text.decode("utf-8", "replace").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                tokens.append(line)
    tokens += [t.strip() for t in (listed or "").split(",") if t.strip()]
    return tokens


class TokenAuthenticator:
    """Checks bearer tokens in constant time: every known token is compared, whatever the first matches.

    Only SHA-256 digests are kept, so the comparisons take the same time whatever the token's length.
    """

    def __init__(self, tokens: Iterable[str], admin_tokens: Iterable[str] = ()) -> None:
        self._digests: list[tuple[bytes, Scope]] = [(_digest(t), Scope.INFER) for t in tokens]
        self._digests += [(_digest(t), Scope.ADMIN) for t in admin_tokens]
        #: Whether any token has the admin scope.
        self.has_admin = any(scope == Scope.ADMIN for _, scope in self._digests)
        if not self._digests:
            raise SecurityConfigError("authentication needs at least one token")

    def scope_of(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Scope | None:
        """The scope of the bearer token in a call's metadata, or None when it has no valid one."""
        presented: str | bytes | None = None
        for key, value in metadata or ():
            if key == "authorization":
                presented = value
                break
        if presented is None:
            return None
        if isinstance(presented, bytes):
            presented = presented.decode("latin-1")
        scheme, _, token = presented.partition(" ")
        digest = _digest(token.strip())
        found = 0
        for known, scope in self._digests:
            # NOTE: no early exit: the time taken must not say which token (or how much of one) matched.
            if hmac.compare_digest(known, digest):
                found = max(found, int(scope))
        if scheme.lower() != "bearer" or not found:
            return None
        return Scope(found)


def stage_token_of(settings: RouterToken | StageToken) -> str | None:
    """The router's stage token: `--stage-token` (or `PIPELINE_STAGE_TOKEN`), else the first token of the
    file `PIPELINE_STAGE_TOKEN_FILE` names (a mounted secret); None when none is set."""
    if settings.stage_token:
        return settings.stage_token.strip()
    from_file = read_tokens(settings.stage_token_file)
    if len(from_file) > 1:
        raise SecurityConfigError("PIPELINE_STAGE_TOKEN_FILE: one token expected, found several")
    return from_file[0] if from_file else None


def authenticator_of(
    security: Security, *, stage_token: StageToken | None = None
) -> TokenAuthenticator | None:
    """The authenticator a server's settings ask for, or None when no token is configured. With
    `stage_token` (a stage service's) the router's token is accepted too, with the infer scope."""
    tokens = read_tokens(security.auth_tokens_file, security.auth_tokens)
    admin = read_tokens(security.admin_tokens_file, security.admin_tokens)
    router = stage_token_of(stage_token) if stage_token is not None else None
    if router is not None:
        tokens.append(router)
    if not tokens and not admin:
        return None
    return TokenAuthenticator(tokens, admin)


@dataclasses.dataclass(frozen=True)
class AccessPolicy:
    """Who may call what on one server: bearer tokens, and client certificates where the server requires
    them (mutual TLS). A call has the higher of its token's and its certificate's scopes."""

    tokens: TokenAuthenticator | None = None
    #: The server verifies client certificates (`--tls-ca`): one the CA signed may infer.
    client_certificates: bool = False
    #: Where not empty, only certificates with one of these identities may infer.
    identities: frozenset[str] = frozenset()
    #: Certificates with one of these identities may do everything.
    admin_identities: frozenset[str] = frozenset()

    @property
    def enabled(self) -> bool:
        """Whether any credential is asked for: tokens configured, or client certificates required."""
        return self.tokens is not None or self.client_certificates

    @property
    def admin_configured(self) -> bool:
        """Whether some credential has the admin scope: an admin token, or an admin certificate identity."""
        return bool(self.admin_identities) or (self.tokens is not None and self.tokens.has_admin)

    def token_scope(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Scope | None:
        """The scope of the call's bearer token (None: no valid token)."""
        return None if self.tokens is None else self.tokens.scope_of(metadata)

    def certificate_scope(self, auth_context: Mapping[str, Iterable[bytes]]) -> Scope | None:
        """The scope of the call's client certificate, from gRPC's auth context (None: none, or no scope)."""
        names = {
            value.decode("utf-8", "replace")
            for key in ("x509_common_name", "x509_subject_alternative_name")
            for value in auth_context.get(key, ())
        }
        return self.identity_scope(names)

    def identity_scope(self, names: Iterable[str]) -> Scope | None:
        """The scope of a verified client certificate whose identities are `names` (its subject CN and
        subject alternative names); None where it has none, no certificate was verified, or none is asked
        for."""
        names = set(names)
        if not self.client_certificates or not names:
            return None
        if names & self.admin_identities:
            return Scope.ADMIN
        if self.identities and not names & self.identities:
            return None
        return Scope.INFER

    def scope(
        self, metadata: Sequence[tuple[str, str | bytes]] | None, names: Iterable[str] = ()
    ) -> Scope | None:
        """A caller's scope: the higher of its bearer token's and its client certificate's (`names`, as
        `identity_scope` takes them); None where neither has one."""
        return highest(self.token_scope(metadata), self.identity_scope(names))


def highest(*scopes: Scope | None) -> Scope | None:
    """The highest of the scopes given (None where all are None)."""
    return max((scope for scope in scopes if scope is not None), default=None)


def certificate_names(certificate: Mapping[str, Any] | None) -> frozenset[str]:
    """The identities of a verified peer certificate as Python's `ssl` gives it (`SSLObject.getpeercert()`,
    an asyncio transport's `peercert`): its subject CN and subject alternative names, the names gRPC's auth
    context lists (`x509_common_name`, `x509_subject_alternative_name`), IP addresses written as gRPC writes
    them. Empty where there is no certificate."""
    if not certificate:
        return frozenset()
    names = {value for rdn in certificate.get("subject", ()) for key, value in rdn if key == "commonName"}
    for kind, value in certificate.get("subjectAltName", ()):
        names.add(str(ipaddress.ip_address(value.strip())) if kind == "IP Address" else value)
    return frozenset(names)


def access_policy_of(security: Security, *, stage_token: StageToken | None = None) -> AccessPolicy:
    """The access policy a server's settings ask for (`stage_token`: a stage service's, which accepts the
    router's token)."""
    listed, admins = security.tls_identities, security.tls_admin_identities
    client_certificates = bool(security.tls_ca)
    if (listed or admins) and not client_certificates:
        raise SecurityConfigError(
            "--tls-identities and --tls-admin-identities need client certificates: give --tls-ca too"
        )
    return AccessPolicy(
        authenticator_of(security, stage_token=stage_token),
        client_certificates=client_certificates,
        identities=frozenset(listed),
        admin_identities=frozenset(admins),
    )


Request = TypeVar("Request")
Response = TypeVar("Response")


def _refusing(
    handler: grpc.RpcMethodHandler[Request, Response], code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler[Request, Response]:
    """A handler in `handler`'s place that answers every call with `code` before reading its request: it takes
    the request as a stream (the same bytes on the wire) and reads none of it, so a refused call's message,
    however large, is never parsed nor kept."""

    async def unary(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await abort(context, code, message)

    async def streaming(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await abort(context, code, message)
        return
        yield  # pragma: no cover - makes this an async generator that yields nothing

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            streaming, response_serializer=handler.response_serializer
        )
    return grpc.stream_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)


#: What a refused caller is told: the same words whether the token was missing, malformed or unknown.
UNAUTHENTICATED_MESSAGE = "missing or invalid credentials: send 'authorization: Bearer <token>'"


def _refusal(method: str, scope: Scope | None) -> tuple[grpc.StatusCode, str] | None:
    """Why a call of `method` with `scope` is refused, or None when it may go on."""
    if scope is None:
        return grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE
    if method in ADMIN_METHODS and scope < Scope.ADMIN:
        name = method.rsplit("/", 1)[-1]
        return (
            grpc.StatusCode.PERMISSION_DENIED,
            f"{name} needs an admin token (or a client certificate listed in --tls-admin-identities)",
        )
    return None


def _checked(
    handler: grpc.RpcMethodHandler[Request, Response],
    check: Callable[[grpc.aio.ServicerContext], tuple[grpc.StatusCode, str] | None],
) -> grpc.RpcMethodHandler[Request, Response]:
    """`handler`, running `check` on each call's context first: a refusal aborts the call."""
    streaming_in, streaming_out = bool(handler.request_streaming), bool(handler.response_streaming)
    # The one behaviour a handler of its kind has (the other three are None).
    behaviour: Callable[..., Any] = getattr(
        handler,
        {
            (False, False): "unary_unary",
            (False, True): "unary_stream",
            (True, False): "stream_unary",
            (True, True): "stream_stream",
        }[(streaming_in, streaming_out)],
    )

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        refusal = check(context)
        if refusal is not None:
            await abort(context, *refusal)
            return None
        return await behaviour(request, context)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        refusal = check(context)
        if refusal is not None:
            await abort(context, *refusal)
            return
        async for reply in behaviour(request, context):
            yield reply

    kinds: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    return kinds[(streaming_in, streaming_out)](
        streaming if streaming_out else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without valid credentials (UNAUTHENTICATED) and management calls without the admin
    scope (PERMISSION_DENIED), as an `AccessPolicy` says; health and liveness/readiness stay open. With
    `door` (the compiled front's secret), a call that carries it has the client certificate whose identities
    it names."""

    def __init__(self, policy: AccessPolicy | TokenAuthenticator, door: str | None = None) -> None:
        self.policy = policy if isinstance(policy, AccessPolicy) else AccessPolicy(policy)
        self.door = door

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Request, Response] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Request, Response] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in OPEN_METHODS:
            return handler
        policy = self.policy
        token = policy.token_scope(handler_call_details.invocation_metadata)
        refusal = _refusal(method, token)
        if refusal is None:
            return handler
        names = self._door_identities(handler_call_details.invocation_metadata)
        if names:
            refusal = _refusal(method, highest(token, policy.identity_scope(names)))
            return handler if refusal is None else _refusing(handler, *refusal)
        if not policy.client_certificates:
            return _refusing(handler, *refusal)

        # NOTE: the certificate is known only to the call's own context, not to the interceptor.
        def check(context: grpc.aio.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
            return _refusal(method, highest(token, policy.certificate_scope(context.auth_context())))

        return _checked(handler, check)

    def _door_identities(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> list[str]:
        """The client certificate's identities the front names, where the call carries the door's secret."""
        if self.door is None or not metadata or not _carries_secret(metadata, self.door):
            return []
        return [value for key, value in metadata if key == IDENTITIES_HEADER and isinstance(value, str)]


def _carries_secret(metadata: Sequence[tuple[str, str | bytes]] | None, door: str) -> bool:
    """Whether a call's metadata carries the compiled front's secret."""
    presented = next((value for key, value in metadata or () if key == DOOR_HEADER), None)
    return isinstance(presented, str) and hmac.compare_digest(presented.encode(), door.encode())


#: What a call to the router's gRPC port behind its compiled front is told where it does not come from the front.
FRONT_ONLY_MESSAGE = "this port takes the compiled front's calls alone: call the router's public gRPC port"


class FrontOnlyInterceptor(grpc.aio.ServerInterceptor):
    """The router's gRPC port behind its compiled front (on loopback, in plaintext) answers the front alone:
    a call without the front's secret (`DOOR_HEADER`), health's too, is refused (UNAUTHENTICATED), so that
    no client reaches the router past the TLS and client certificates the front's port asks for."""

    def __init__(self, door: str) -> None:
        self.door = door

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Request, Response] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Request, Response] | None:
        handler = await continuation(handler_call_details)
        if handler is None or _carries_secret(handler_call_details.invocation_metadata, self.door):
            return handler
        return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, FRONT_ONLY_MESSAGE)


def interceptors_of(policy: AccessPolicy, door: str | None = None) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors that enforce `policy` (none where it asks for no credential); `door`: the compiled
    front's secret, which every call to a router's gRPC port behind the front must carry (`FrontOnlyInterceptor`)
    and with which a forwarded call names its client's certificate."""
    front: list[grpc.aio.ServerInterceptor] = [] if door is None else [FrontOnlyInterceptor(door)]
    return [*front, AuthInterceptor(policy, door)] if policy.enabled else front


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token (empty without one): works on plaintext channels too."""
    return (("authorization", f"Bearer {token}"),) if token else ()

"""TLS on every hop and optional per-request authentication.

TLS: every server takes `--tls-cert`/`--tls-key` (PEM files; the server then listens with TLS only) and
`--tls-ca` (clients must then present a certificate signed by it: mutual TLS). The router's calls of its
stages use `--stage-tls-ca`/`--stage-tls-cert`/`--stage-tls-key` (env `PIPELINE_STAGE_TLS_*`), and
clients (`InferenceClient`, `pipeline infer`) take the same three files.

Authentication (the router): bearer tokens, `authorization: Bearer <token>` in the call's metadata, checked
per request against a set of tokens (file or environment) in constant time. Two scopes: `infer` (every RPC
but the management ones) and `admin` (everything, including `RepositoryModelLoad`/`Unload`). Health stays
open: `grpc.health.v1.Health` and `ServerLive`/`ServerReady` never ask for a token, so probes need none.
A refused call learns only that its credentials were missing or wrong (UNAUTHENTICATED), never which part;
a valid token without the scope gets PERMISSION_DENIED.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from enum import IntEnum
from pathlib import Path
from typing import Any

import grpc

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


def channel_credentials(
    ca: str | os.PathLike[str] | None,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
) -> grpc.ChannelCredentials | None:
    """TLS channel credentials from PEM files (the CA to trust; a client certificate for mutual TLS), or
    None (plaintext) when none is given."""
    ca_pem = _read(ca, "TLS CA")
    cert_pem, key_pem = _read(cert, "TLS certificate"), _read(key, "TLS key")
    if ca_pem is None and cert_pem is None and key_pem is None:
        return None
    if (cert_pem is None) != (key_pem is None):
        raise SecurityConfigError("a client certificate needs both its certificate and its key")
    # NOTE: without a CA the system's trust store is used (a server with a public certificate).
    return grpc.ssl_channel_credentials(
        root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem
    )


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """`--tls-cert`, `--tls-key`, `--tls-ca` for a server (env `PIPELINE_TLS_CERT`, ...)."""
    env = os.environ.get
    parser.add_argument(
        "--tls-cert",
        default=env("PIPELINE_TLS_CERT") or None,
        help="PEM certificate (chain): serve with TLS only (env PIPELINE_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key", default=env("PIPELINE_TLS_KEY") or None, help="PEM private key (env PIPELINE_TLS_KEY)"
    )
    parser.add_argument(
        "--tls-ca",
        default=env("PIPELINE_TLS_CA") or None,
        help="PEM CA: clients must present a certificate signed by it, i.e. mutual TLS (env PIPELINE_TLS_CA)",
    )


def server_credentials_of(args: argparse.Namespace) -> grpc.ServerCredentials | None:
    """The server credentials that a service's parsed flags ask for (None: plaintext)."""
    return server_credentials(
        getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_ca", None)
    )


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


def server_ssl_context_of(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The TLS context that a service's parsed flags ask for (None: plaintext)."""
    return server_ssl_context(
        getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_ca", None)
    )


def add_client_tls_arguments(parser: argparse.ArgumentParser, *, prefix: str, env_prefix: str) -> None:
    """`--<prefix>tls-ca/cert/key` for a client side (env `<env_prefix>TLS_CA`, ...)."""
    env = os.environ.get
    for part, text in (
        ("ca", "PEM CA that signed the server's certificate (turns TLS on)"),
        ("cert", "PEM client certificate, for servers that require one (mutual TLS)"),
        ("key", "PEM key of the client certificate"),
    ):
        variable = f"{env_prefix}TLS_{part.upper()}"
        parser.add_argument(
            f"--{prefix}tls-{part}",
            default=env(variable) or None,
            help=f"{text} (env {variable})",
        )


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


def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's token flags; authentication is on when any token is configured."""
    env = os.environ.get
    parser.add_argument(
        "--auth-tokens-file",
        default=env("PIPELINE_AUTH_TOKENS_FILE") or None,
        help="file of bearer tokens allowed to infer, one a line; with it (or PIPELINE_AUTH_TOKENS, "
        "comma-separated) every RPC but health needs 'authorization: Bearer <token>' "
        "(env PIPELINE_AUTH_TOKENS_FILE)",
    )
    parser.add_argument(
        "--admin-tokens-file",
        default=env("PIPELINE_ADMIN_TOKENS_FILE") or None,
        help="file of bearer tokens allowed everything, RepositoryModelLoad/Unload included (or "
        "PIPELINE_ADMIN_TOKENS, comma-separated; env PIPELINE_ADMIN_TOKENS_FILE)",
    )


def authenticator_of(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> TokenAuthenticator | None:
    """The authenticator a router's flags and environment ask for, or None when no token is configured."""
    environ = os.environ if environ is None else environ
    tokens = read_tokens(getattr(args, "auth_tokens_file", None), environ.get("PIPELINE_AUTH_TOKENS"))
    admin = read_tokens(getattr(args, "admin_tokens_file", None), environ.get("PIPELINE_ADMIN_TOKENS"))
    if not tokens and not admin:
        return None
    return TokenAuthenticator(tokens, admin)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers every call with `code`."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises; the yield makes this an async generator

    kinds: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    kind = (bool(handler.request_streaming), bool(handler.response_streaming))
    return kinds[kind](
        streaming if kind[1] else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


#: What a refused caller is told: the same words whether the token was missing, malformed or unknown.
UNAUTHENTICATED_MESSAGE = "missing or invalid credentials: send 'authorization: Bearer <token>'"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid token (UNAUTHENTICATED) and management calls without the admin scope
    (PERMISSION_DENIED); health and liveness/readiness stay open."""

    def __init__(self, authenticator: TokenAuthenticator) -> None:
        self.authenticator = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in OPEN_METHODS:
            return handler
        scope = self.authenticator.scope_of(handler_call_details.invocation_metadata)  # type: ignore[arg-type]
        if scope is None:
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        if method in ADMIN_METHODS and scope < Scope.ADMIN:
            name = method.rsplit("/", 1)[-1]
            return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED, f"{name} needs an admin token")
        return handler


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token (empty without one): works on plaintext channels too."""
    return (("authorization", f"Bearer {token}"),) if token else ()

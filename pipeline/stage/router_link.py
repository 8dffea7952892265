"""The stage service's link to the router, on which the calls its models make to other models go
(`pipeline.stage.bls`). How they travel is the stage-transport seam's choice
(`pipeline.transport.server_link`), as for the router's own calls of its stages: the router's frame port
where it names one (the protocol's messages without gRPC's cost per message, with the TLS and token of the
gRPC channel), else one shared `ModelStreamInfer` stream; calls to decoupled models go on a stream of their
own, and the callees' `max_batch_size` is asked once per model.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.runtime.server import server_options
from pipeline.transport import ServerLink

log = logging.getLogger(__name__)


class RouterClient:
    """The service's link to the router, on which its models' calls go. The router's address is `address`,
    or read from `port_file` (with `host`) at the first call, for a router started after the service on a
    port the OS picked. `credentials` and `tls` (None: plaintext), the gRPC channel's and the frame
    connection's TLS, and `token` (the router's clients' bearer token) go with every call."""

    def __init__(
        self,
        address: str | None,
        *,
        port_file: Path | None = None,
        host: str = "127.0.0.1",
        max_message_bytes: int = 64 * 1024 * 1024,
        credentials: grpc.ChannelCredentials | None = None,
        tls: ssl.SSLContext | None = None,
        token: str | None = None,
    ) -> None:
        self._credentials = credentials
        self._tls = tls
        self._address = address
        self._port_file = port_file
        self._host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        self._max_message_bytes = max_message_bytes
        self._auth = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel: grpc.aio.Channel | None = None
        self._link: ServerLink | None = None
        self._batch_sizes: dict[str, asyncio.Task[int]] = {}

    @property
    def configured(self) -> bool:
        return self._address is not None or self._port_file is not None

    def _connect(self) -> ServerLink:
        if self._link is not None:
            return self._link
        address = self._address
        if address is None and self._port_file is not None:
            try:
                address = f"{self._host}:{int(self._port_file.read_text().strip())}"
            except (OSError, ValueError) as exc:
                raise ConnectionError(
                    f"cannot read the router's port from {self._port_file}: {exc}"
                ) from None
        if address is None:
            raise ConnectionError("no router address")
        options = server_options(self._max_message_bytes)
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(address, self._credentials, options=options)
        self._link = ServerLink(address, self._channel, self._auth, self._max_message_bytes, tls=self._tls)
        return self._link

    async def infer(
        self, request: pb.ModelInferRequest, timeout: float | None, context: Mapping[str, str]
    ) -> pb.ModelInferResponse:
        """One call; `context` is the call's trace context and chain. A call that fails raises the
        `grpc.aio.AioRpcError` a unary call would have raised."""
        return await self._connect().infer(request, timeout, (*context.items(), *self._auth))

    def stream(
        self, request: pb.ModelInferRequest, timeout: float | None, metadata: Sequence[tuple[str, str]]
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """A decoupled model's responses, up to the final one (asked for even when empty)."""
        return self._connect().decoupled(request, timeout, metadata)

    async def max_batch_size(self, model: str) -> int:
        """The callee's `max_batch_size` as the router's `ModelConfig` says (0: it does not batch, or the
        router cannot say now), asked once per model."""
        known = self._batch_sizes.get(model)
        if known is None:
            known = self._batch_sizes[model] = asyncio.ensure_future(self._ask_batch_size(model))
        return await asyncio.shield(known)

    async def _ask_batch_size(self, model: str) -> int:
        try:
            reply = await self._connect().stub.ModelConfig(
                pb.ModelConfigRequest(name=model), timeout=5.0, metadata=self._auth
            )
        except (grpc.aio.AioRpcError, ConnectionError):
            del self._batch_sizes[model]  # asked again by the next call
            return 0
        return int(reply.config.max_batch_size)

    async def close(self) -> None:
        if self._link is not None:
            self._link.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._link = None

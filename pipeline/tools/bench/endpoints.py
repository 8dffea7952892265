"""How `pipeline bench` talks to a server: the protocol's gRPC or HTTP/REST side, behind one interface.

Each endpoint answers the metadata and statistics calls with the protocol's messages (the REST side's JSON
is parsed into them), and turns a request into a payload built once and sent as it is on every call, so the
load generator does the same cheap work over either protocol: no message is built or parsed per request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import aiohttp
import grpc
from google.protobuf import json_format

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.streams import status_of
from pipeline.router.frontdoor.rest_codec import HEADER_LENGTH
from pipeline.runtime.security import ClientTls
from pipeline.runtime.server import server_options

#: The RPCs the gRPC load is made of, called with pre-serialised bytes.
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
PROTOCOLS = ("grpc", "http")
#: Response parameter (Triton's): true on the last response of a request to a decoupled model.
FINAL_RESPONSE = "triton_final_response"
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}

#: One call of the load: send a payload within a timeout (seconds); raises on any failure. A streamed call
#: returns when each of its responses with outputs arrived (`time.perf_counter`), a unary one None.
Call = Callable[[Any, float], Awaitable[Sequence[float] | None]]


class EndpointError(Exception):
    """A call failed; `code` is the status to count it under (a gRPC code name, or `HTTP_<status>`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class GrpcEndpoint:
    """The protocol's gRPC side."""

    def __init__(
        self,
        url: str,
        max_message_bytes: int,
        connections: int = 1,
        token: str | None = None,
        tls: ClientTls | None = None,
    ) -> None:

        #: Sent with every call where the server asks for a token.
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

        options = server_options(max_message_bytes)
        # Each channel its own connection: gRPC would otherwise share one among channels to one address.
        options.append(("grpc.use_local_subchannel_pool", 1))
        if tls is None:
            self.channels = [grpc.aio.insecure_channel(url, options=options) for _ in range(connections)]
        else:
            self.channels = [
                grpc.aio.secure_channel(url, tls.credentials, options=options) for _ in range(connections)
            ]
        self.channel = self.channels[0]
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)

    async def _rpc(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self.stub, method)(request, timeout=10, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise EndpointError(err.code().name, err.details() or "") from None

    async def server_metadata(self) -> pb.ServerMetadataResponse:
        return await self._rpc("ServerMetadata", pb.ServerMetadataRequest())

    async def model_metadata(self, model: str, version: str) -> pb.ModelMetadataResponse:
        return await self._rpc("ModelMetadata", pb.ModelMetadataRequest(name=model, version=version))

    async def model_config(self, model: str, version: str) -> mc.ModelConfig:
        reply = await self._rpc("ModelConfig", pb.ModelConfigRequest(name=model, version=version))
        return reply.config

    async def statistics(self) -> pb.ModelStatisticsResponse:
        return await self._rpc("ModelStatistics", pb.ModelStatisticsRequest())

    async def ready(self) -> None:
        await asyncio.gather(*(channel.channel_ready() for channel in self.channels))

    def payload(self, request: pb.ModelInferRequest) -> bytes:
        return request.SerializeToString()

    def call(self) -> Call:
        infers: Iterator[grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = itertools.cycle(
            [channel.unary_unary(MODEL_INFER) for channel in self.channels]
        )
        metadata = self.metadata

        async def call(payload: bytes, timeout: float) -> None:
            try:
                await next(infers)(payload, timeout=timeout, metadata=metadata)
            except grpc.aio.AioRpcError as err:
                raise EndpointError(err.code().name, err.details() or "") from None

        return call

    def stream_call(self) -> Call:
        """Each call sends its request alone over a new `ModelStreamInfer` stream and reads its responses
        up to the one flagged `triton_final_response` (or the end of the stream, for a model that answers
        once). Only the responses that carry outputs count as arrivals: an empty final response only ends
        the request."""
        streams: Iterator[grpc.aio.StreamStreamMultiCallable[bytes, pb.ModelStreamInferResponse]] = (
            itertools.cycle(
                [
                    channel.stream_stream(
                        MODEL_STREAM_INFER, response_deserializer=pb.ModelStreamInferResponse.FromString
                    )
                    for channel in self.channels
                ]
            )
        )
        metadata = self.metadata
        now = time.perf_counter

        async def call(payload: bytes, timeout: float) -> list[float]:
            arrivals: list[float] = []
            stream = next(streams)(iter((payload,)), timeout=timeout, metadata=metadata)
            try:
                async for reply in stream:
                    at = now()
                    if reply.error_message:
                        code = _CODE_NAMES.get(status_of(reply).code, "UNKNOWN")
                        raise EndpointError(code, reply.error_message)
                    response = reply.infer_response
                    if response.outputs:
                        arrivals.append(at)
                    final = response.parameters.get(FINAL_RESPONSE)
                    if final is not None and final.bool_param:
                        break
            except grpc.aio.AioRpcError as err:
                raise EndpointError(err.code().name, err.details() or "") from None
            finally:
                stream.cancel()  # a no-op once the server has ended the stream
            return arrivals

        return call

    async def close(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self.channels))


class HttpEndpoint:
    """The protocol's HTTP/REST side (aiohttp), tensors as Triton's binary tensor data, both ways."""

    def __init__(
        self, url: str, model: str, version: str, token: str | None = None, tls: ClientTls | None = None
    ) -> None:
        base = url if "://" in url else f"{'http' if tls is None else 'https'}://{url}"
        self.base = base.rstrip("/")
        self.path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
        # No cap on connections: each closed-loop worker keeps its own, as gRPC streams would.
        headers = {"Authorization": f"Bearer {token}"} if token else None
        connector = aiohttp.TCPConnector(limit=0, ssl=True if tls is None else tls.ssl_context)
        self.session = aiohttp.ClientSession(connector=connector, headers=headers)

    async def _get(self, path: str) -> Any:
        async with self.session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=10)) as reply:
            body = await reply.read()
            if reply.status != 200:
                raise EndpointError(f"HTTP_{reply.status}", _error_text(body))
            return json.loads(body)

    async def server_metadata(self) -> pb.ServerMetadataResponse:
        return json_format.ParseDict(await self._get("/v2"), pb.ServerMetadataResponse())

    async def model_metadata(self, model: str, version: str) -> pb.ModelMetadataResponse:
        return json_format.ParseDict(await self._get(self.path), pb.ModelMetadataResponse())

    async def model_config(self, model: str, version: str) -> mc.ModelConfig:
        doc = await self._get(self.path + "/config")
        return json_format.ParseDict(doc, mc.ModelConfig(), ignore_unknown_fields=True)

    async def statistics(self) -> pb.ModelStatisticsResponse:
        doc = await self._get("/v2/models/stats")
        return json_format.ParseDict(doc, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    async def ready(self) -> None:
        await self._get("/v2")

    def payload(self, request: pb.ModelInferRequest) -> tuple[bytes, int]:
        """The request as binary tensor data: its JSON header and length, then every input's raw bytes;
        every output is asked for as binary data."""
        header = {
            "inputs": [
                {
                    "name": tensor.name,
                    "datatype": tensor.datatype,
                    "shape": list(tensor.shape),
                    "parameters": {"binary_data_size": len(raw)},
                }
                for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True)
            ],
            "parameters": {"binary_data_output": True},
        }
        text = json.dumps(header).encode()
        return text + b"".join(request.raw_input_contents), len(text)

    def call(self) -> Call:
        url = self.base + self.path + "/infer"
        session = self.session

        async def call(payload: tuple[bytes, int], timeout: float) -> None:
            body, header_length = payload
            headers = {HEADER_LENGTH: str(header_length), "Content-Type": "application/octet-stream"}
            limit = aiohttp.ClientTimeout(total=timeout)
            async with session.post(url, data=body, headers=headers, timeout=limit) as reply:
                content = await reply.read()
                if reply.status != 200:
                    raise EndpointError(f"HTTP_{reply.status}", _error_text(content))

        return call

    async def close(self) -> None:
        await self.session.close()


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


def open_endpoint(
    protocol: str,
    url: str,
    *,
    model: str,
    version: str,
    max_message_bytes: int,
    connections: int = 1,
    token: str | None = None,
    tls: ClientTls | None = None,
) -> GrpcEndpoint | HttpEndpoint:
    """The endpoint of a protocol (`grpc` or `http`) at `url` (`connections`: gRPC connections to spread
    calls over; `token`: the bearer token every call carries, where the server asks for one; `tls`: TLS,
    else plaintext)."""
    if protocol == "http":
        return HttpEndpoint(url, model, version, token, tls)
    return GrpcEndpoint(url, max_message_bytes, connections, token, tls)

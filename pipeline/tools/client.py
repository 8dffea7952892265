"""A small synchronous client for any Open Inference Protocol gRPC endpoint (the router or a stage)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import Tensor, response_tensors
from pipeline.protocol.datatypes import DATATYPES
from pipeline.protocol.sequences import SequenceId, set_sequence
from pipeline.runtime.security import bearer_metadata, channel_credentials
from pipeline.runtime.server import server_options

#: Response parameter (Triton's): true on the last response of a request to a decoupled model.
FINAL_RESPONSE = "triton_final_response"
#: Request parameter (Triton's): send the final flag in an empty response when the model's last response
#: carried none, so that the client always learns where a request's responses end.
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"


class StreamError(Exception):
    """A streamed request failed: the server's `error_message` for it."""


@dataclass(frozen=True, slots=True)
class StreamResponse:
    """One response of a streamed request: its outputs (none in an empty final response) and whether it
    is the request's last."""

    outputs: dict[str, np.ndarray]
    final: bool


class InferenceClient:
    """Calls `inference.GRPCInferenceService` at `url` (host:port) with numpy arrays in and out.

    `tls_ca` (PEM file) turns TLS on and says whom to trust; `tls_cert`/`tls_key` present a client
    certificate (mutual TLS); `token` goes with every inference call as `authorization: Bearer <token>`.
    """

    def __init__(
        self,
        url: str,
        *,
        max_message_bytes: int = 64 * 1024 * 1024,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        token: str | None = None,
    ) -> None:
        options = server_options(max_message_bytes)
        credentials = channel_credentials(tls_ca, tls_cert, tls_key)
        if credentials is None:
            self.channel = grpc.insecure_channel(url, options=options)
        else:
            self.channel = grpc.secure_channel(url, credentials, options=options)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.auth = bearer_metadata(token)

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel (also on leaving a `with` block)."""
        self.channel.close()

    def server_ready(self, timeout: float | None = None) -> bool:
        """The server's `ServerReady` answer."""
        return self.stub.ServerReady(pb.ServerReadyRequest(), timeout=timeout).ready

    def model_metadata(self, model: str, timeout: float | None = None) -> pb.ModelMetadataResponse:
        """The model's `ModelMetadata`: its versions, platform, inputs and outputs."""
        return self.stub.ModelMetadata(
            pb.ModelMetadataRequest(name=model), timeout=timeout, metadata=self.auth
        )

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        outputs: Sequence[str] = (),
        timeout: float | None = None,
        request_id: str = "",
        metadata: Sequence[tuple[str, str]] = (),
        sequence: SequenceId | None = None,
    ) -> dict[str, np.ndarray]:
        """Run one request (of `sequence`, for a stateful model); returns every output (or those named) as
        arrays."""
        request = _request(model, inputs, request_id)
        if sequence is not None:
            set_sequence(request, sequence)
        for name in outputs:
            request.outputs.add(name=name)
        response = self.stub.ModelInfer(request, timeout=timeout, metadata=(*self.auth, *metadata))
        return {name: tensor.to_array() for name, tensor in response_tensors(response).items()}

    def stream(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        timeout: float | None = None,
        request_id: str = "",
        sequence: SequenceId | None = None,
    ) -> Iterator[StreamResponse]:
        """Send one request over `ModelStreamInfer` and yield its responses as they arrive, up to the one
        flagged `triton_final_response` (a decoupled model's many), or the one a server answers when it does
        not flag them (any other model). A failed request raises `StreamError`; `timeout` bounds the whole
        stream."""
        request = _request(model, inputs, request_id)
        if sequence is not None:
            set_sequence(request, sequence)
        request.parameters[EMPTY_FINAL_RESPONSE].bool_param = True
        # One request, then the client's side of the stream is closed: the server answers it and ends.
        call = self.stub.ModelStreamInfer(iter([request]), timeout=timeout, metadata=self.auth)
        try:
            for reply in call:
                if reply.error_message:
                    raise StreamError(reply.error_message)
                response = reply.infer_response
                final = (
                    response.parameters[FINAL_RESPONSE].bool_param
                    if FINAL_RESPONSE in response.parameters
                    else False
                )
                outputs = {name: tensor.to_array() for name, tensor in response_tensors(response).items()}
                yield StreamResponse(outputs, final)
                if final:
                    return
        finally:
            call.cancel()  # a no-op once the server has ended the stream; stops it when the caller stopped early


def _request(model: str, inputs: Mapping[str, np.ndarray], request_id: str) -> pb.ModelInferRequest:
    """A `ModelInferRequest` of `inputs`, each in `raw_input_contents`."""
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    for name, array in inputs.items():
        tensor = Tensor.from_array(name, np.asarray(array))
        request.inputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
        request.raw_input_contents.append(tensor.raw)
    return request


def bytes_batch(items: Sequence[bytes], shape: Sequence[int]) -> np.ndarray:
    """A BYTES array of `items` shaped like a model input whose dims are [-1] or [-1, 1]."""
    array = np.empty(len(items), dtype=object)
    array[:] = list(items)
    return array.reshape((len(items), *([1] * (len(shape) - 1))))


def value_array(datatype: str, text: str, shape: Sequence[int]) -> np.ndarray:
    """An input of `shape` holding one value given as text: its UTF-8 bytes for BYTES, else a number (or
    true/false) of `datatype`; `ValueError` saying why it cannot be one."""
    if datatype == "BYTES":
        array = np.empty(tuple(shape), dtype=object)
        array.reshape(-1)[:] = [text.encode()] * array.size
        return array
    dtype = DATATYPES.get(datatype)
    if dtype is None:
        raise ValueError(f"unknown datatype {datatype}")
    try:
        if dtype.kind == "b":
            value: object = {"true": True, "1": True, "false": False, "0": False}[text.lower()]
        else:
            value = float(text) if dtype.kind == "f" else int(text, 0)
        return np.full(tuple(shape), value, dtype=dtype)
    except (ValueError, KeyError, OverflowError):
        raise ValueError(f"{text!r} is not a value of datatype {datatype}") from None

"""A small synchronous client for any Open Inference Protocol gRPC endpoint (the router or a stage)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import grpc
import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import Tensor, response_tensors
from pipeline.runtime.security import bearer_metadata, channel_credentials
from pipeline.runtime.server import server_options


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
        self.channel.close()

    def server_ready(self, timeout: float | None = None) -> bool:
        return self.stub.ServerReady(pb.ServerReadyRequest(), timeout=timeout).ready

    def model_metadata(self, model: str, timeout: float | None = None) -> pb.ModelMetadataResponse:
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
    ) -> dict[str, np.ndarray]:
        """Run one request; returns every output (or those named) as arrays."""
        request = pb.ModelInferRequest(model_name=model, id=request_id)
        for name, array in inputs.items():
            tensor = Tensor.from_array(name, np.asarray(array))
            request.inputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
            request.raw_input_contents.append(tensor.raw)
        for name in outputs:
            request.outputs.add(name=name)
        response = self.stub.ModelInfer(request, timeout=timeout, metadata=(*self.auth, *metadata))
        return {name: tensor.to_array() for name, tensor in response_tensors(response).items()}


def bytes_batch(items: Sequence[bytes], shape: Sequence[int]) -> np.ndarray:
    """A BYTES array of `items` shaped like a model input whose dims are [-1] or [-1, 1]."""
    array = np.empty(len(items), dtype=object)
    array[:] = list(items)
    return array.reshape((len(items), *([1] * (len(shape) - 1))))

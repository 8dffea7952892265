"""A server that speaks the protocol as Triton does for a decoupled model: many responses per request over
`ModelStreamInfer`, the last flagged with the parameter `triton_final_response`, errors in `error_message`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.codec import Tensor, request_tensors
from pipeline.tools.client import bytes_batch


def _text(chunk: bytes) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name="writer", id="")
    tensor = Tensor.from_array("TEXT", bytes_batch([chunk], (-1, 1)))
    response.outputs.add(name="TEXT", datatype="BYTES", shape=tensor.shape)
    response.raw_output_contents.append(tensor.raw)
    return response


class Writer(pb_grpc.GRPCInferenceServiceServicer):
    """`writer`: PROMPT BYTES [-1, 1] and COUNT INT32 [-1, 1]; answers COUNT responses, each the prompt's
    next character as TEXT. How it ends depends on the prompt: `plain` answers one response unflagged (a
    model that is not decoupled); `fail` fails after two responses; any other prompt gets the flag on an
    empty final response, and the stream is then held open until the client cancels it."""

    def __init__(self) -> None:
        self.requests: list[pb.ModelInferRequest] = []
        #: Set when a stream the server held open after its final response is cancelled by its client.
        self.cancelled = threading.Event()

    def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="writer-server", version="1")

    def ModelMetadata(self, request, context):
        return pb.ModelMetadataResponse(
            name=request.name,
            inputs=[
                pb.ModelMetadataResponse.TensorMetadata(name="PROMPT", datatype="BYTES", shape=[-1, 1]),
                pb.ModelMetadataResponse.TensorMetadata(name="COUNT", datatype="INT32", shape=[-1, 1]),
            ],
            outputs=[pb.ModelMetadataResponse.TensorMetadata(name="TEXT", datatype="BYTES", shape=[-1, 1])],
        )

    def ModelStreamInfer(self, request_iterator, context) -> Iterator[pb.ModelStreamInferResponse]:
        context.add_callback(self.cancelled.set)
        for request in request_iterator:
            self.requests.append(request)
            tensors = {t.name: t.to_array() for t in request_tensors(request)}
            prompt, count = bytes(tensors["PROMPT"][0, 0]), int(tensors["COUNT"][0, 0])
            if prompt == b"plain":
                yield pb.ModelStreamInferResponse(infer_response=_text(prompt))
                continue
            for i in range(count):
                if prompt == b"fail" and i == 2:
                    yield pb.ModelStreamInferResponse(error_message="writer: the pen broke")
                    break
                response = _text(prompt[i : i + 1])
                response.parameters["triton_final_response"].bool_param = False
                yield pb.ModelStreamInferResponse(infer_response=response)
            else:
                final = pb.ModelInferResponse(model_name="writer")
                final.parameters["triton_final_response"].bool_param = True
                yield pb.ModelStreamInferResponse(infer_response=final)
                self.cancelled.wait(30)  # held open: the client must stop at the flag by itself


@contextmanager
def serving_writer() -> Iterator[tuple[Writer, str]]:
    """A `Writer` on a port the OS picks, and its address."""
    server = grpc.server(futures.ThreadPoolExecutor(16))
    servicer = Writer()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(None)

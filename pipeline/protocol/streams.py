"""What `ModelStreamInfer` carries between this project's processes beyond the protocol's own fields.

The protocol's stream response has only an `error_message`; a unary call's status also has a code and
`google.rpc.Status` details (the items a stage refused, whether it started the call). Our servers put the
whole status of a failed streamed request into its response's parameters, so that a router calling a stage
over a long-lived stream tells errors apart exactly as it does over unary calls; other clients see the
usual `error_message`. Servers that do so list `STREAM_STATUS_EXTENSION` in `ServerMetadata.extensions`.

A streamed request carries in its parameters what a unary call carries in its metadata and deadline: the
time the caller still waits for it and the caller's trace context. A caller that stops waiting for a
request sends a message naming its `id` with `CANCEL_PARAMETER`, which our servers take as a unary call's
cancellation (it is no request of its own; a server that does not know it answers it as an unknown model).

A decoupled model (Triton's `model_transaction_policy { decoupled: true }`) answers a streamed request with
any number of responses, each carrying its request's `id` and Triton's `triton_final_response` parameter,
true on the last. A model may end a request with the final flag alone: that empty response is sent only
to a client that asks for it (`triton_enable_empty_final_response`, tritonclient's
`enable_empty_final_response`), as Triton does; the router always asks its stages for it.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

import grpc
from google.rpc import status_pb2

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.call_chain import CALL_CHAIN_HEADER

#: `ServerMetadata.extensions`: a failed streamed request's response carries its status (`STATUS_PARAMETER`).
STREAM_STATUS_EXTENSION = "pipeline_stream_status"
#: Response parameter: the failed request's `google.rpc.Status`, serialized and base64-encoded.
STATUS_PARAMETER = "pipeline.status"
#: Request parameter: microseconds the caller still waits for the request (a unary call's deadline).
TIMEOUT_PARAMETER = "pipeline.timeout_us"
#: Request parameters carrying the caller's W3C trace context (a unary call's `traceparent` metadata), and
#: the chain of model calls it belongs to (`pipeline.protocol.call_chain`), which travels the same way.
TRACE_PARAMETERS = ("traceparent", "tracestate", CALL_CHAIN_HEADER)
#: Response parameter of a decoupled model's responses: true on a request's last one (Triton's).
FINAL_PARAMETER = "triton_final_response"
#: Request parameter: send the final flag as an empty response where the model sends it alone (Triton's).
EMPTY_FINAL_PARAMETER = "triton_enable_empty_final_response"
#: Request parameter: the caller no longer waits for the request of this message's `id` on the stream.
CANCEL_PARAMETER = "pipeline.cancel"
#: Every parameter above but `CANCEL_PARAMETER`: a server takes them off a request before its model sees it.
HOP_PARAMETERS = frozenset({STATUS_PARAMETER, TIMEOUT_PARAMETER, EMPTY_FINAL_PARAMETER, *TRACE_PARAMETERS})

#: What `ModelInfer` answers for a decoupled model (Triton's words), and an HTTP infer alike.
DECOUPLED_UNARY = (
    "ModelInfer RPC doesn't support models with decoupled transaction policy: model '{model}' answers a "
    "request with any number of responses; call it with ModelStreamInfer (tritonclient's start_stream and "
    "async_stream_infer) or HTTP's generate_stream"
)


def error_response(
    request: pb.ModelInferRequest, code: grpc.StatusCode, message: str, status: status_pb2.Status | None
) -> pb.ModelStreamInferResponse:
    """The stream response of a request that failed: its id, the message, and the status."""
    failed = pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    status = status or status_pb2.Status(code=code.value[0], message=message)
    failed.parameters[STATUS_PARAMETER].string_param = base64.b64encode(status.SerializeToString()).decode()
    return pb.ModelStreamInferResponse(error_message=message, infer_response=failed)


def is_final(response: pb.ModelStreamInferResponse) -> bool:
    """Whether a decoupled model's streamed response is its request's last."""
    param = response.infer_response.parameters.get(FINAL_PARAMETER)
    return param is not None and param.bool_param


def set_final(response: pb.ModelStreamInferResponse, final: bool) -> pb.ModelStreamInferResponse:
    """Mark a decoupled model's streamed response as its request's last, or not; returns it."""
    response.infer_response.parameters[FINAL_PARAMETER].bool_param = final
    return response


def wants_empty_final(request: pb.ModelInferRequest) -> bool:
    """Whether a streamed request asks for the final flag as an empty response where the model sends it alone."""
    param = request.parameters.get(EMPTY_FINAL_PARAMETER)
    return param is not None and param.bool_param


def status_of(response: pb.ModelStreamInferResponse) -> status_pb2.Status:
    """The status of a failed streamed request: what its server sent, else UNKNOWN with its message."""
    param = response.infer_response.parameters.get(STATUS_PARAMETER)
    if param is not None and param.string_param:
        try:
            return status_pb2.Status.FromString(base64.b64decode(param.string_param))
        except ValueError:
            pass
    return status_pb2.Status(code=grpc.StatusCode.UNKNOWN.value[0], message=response.error_message)


def hop_context(
    request: pb.ModelInferRequest, metadata: Sequence[tuple[str, str | bytes]]
) -> tuple[float | None, tuple[tuple[str, str | bytes], ...]]:
    """A streamed request's deadline (seconds) and its metadata with its trace context; takes the hop's
    parameters off the request."""
    parameters = request.parameters
    if not parameters or HOP_PARAMETERS.isdisjoint(parameters):
        return None, tuple(metadata)
    timeout = None
    if TIMEOUT_PARAMETER in parameters:
        timeout = parameters[TIMEOUT_PARAMETER].int64_param / 1e6
    trace = tuple((key, parameters[key].string_param) for key in TRACE_PARAMETERS if key in parameters)
    remove_hop_parameters(request)
    kept = tuple(item for item in metadata if item[0] not in TRACE_PARAMETERS)
    return timeout, (*kept, *trace)


def add_hop_parameters(
    request: pb.ModelInferRequest, timeout: float | None, trace: Mapping[str, str]
) -> None:
    """Put a call's deadline and trace context into a request sent on a stream."""
    if timeout is not None:
        request.parameters[TIMEOUT_PARAMETER].int64_param = max(1, int(timeout * 1e6))
    for key in TRACE_PARAMETERS:
        if key in trace:
            request.parameters[key].string_param = trace[key]


def remove_hop_parameters(request: pb.ModelInferRequest) -> None:
    """Take the hop's parameters off a request again (it may be sent once more, on another path)."""
    for key in HOP_PARAMETERS.intersection(request.parameters):
        del request.parameters[key]

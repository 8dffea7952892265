"""Calls from inside a model to the models the pipeline serves (Triton's Business Logic Scripting).

A Python model calls another model with `pb_utils.InferenceRequest(...).exec()` (or `async_exec()`) while
its `execute` runs. The call goes to the router (`--router`): the router knows every model, stage models
and ensembles alike, and batches the call with all other traffic of the callee, so that a model that fans
out into many calls fills the callee's batches. Each call carries what its caller's request carries:

- the time the caller's request has left (and the request's own `timeout`, if shorter);
- the caller's trace context, so the call's spans sit under the caller's;
- the chain of calls it belongs to (`pipeline.protocol.call_chain`): nested too deep, it is refused; and the
  stage refuses at once a call that only an instance waiting on it could run, instead of hanging;
- cancellation: when the caller's request is cancelled (its client went away), its calls are cancelled.

The calls run on the service's event loop, whatever thread the model runs on: `exec` waits for the answer
on the model's thread, `async_exec` in the model's own event loop. What a model sees of them is in
`pipeline.stage.triton_python_backend_utils`; here they are tensors in and a `Reply` out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import itertools
import json
import logging
import queue
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from opentelemetry import context as otel_context
from opentelemetry.context import Context

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.protocol.call_chain import CALL_CHAIN_HEADER, MAX_DEPTH, ROOT, CallChain
from pipeline.protocol.codec import Tensor, response_tensors
from pipeline.protocol.streams import EMPTY_FINAL_PARAMETER, add_hop_parameters, is_final, status_of
from pipeline.runtime.server import server_options
from pipeline.runtime.telemetry import PROPAGATOR
from pipeline.stage.api import Deadline

log = logging.getLogger(__name__)

#: The request being run on this thread (or task), whose model may call other models.
_CURRENT: contextvars.ContextVar[CallScope | None] = contextvars.ContextVar(
    "pipeline_model_call", default=None
)


def current() -> CallScope | None:
    """The request the calling model is running, or None outside `execute`."""
    return _CURRENT.get()


@dataclass(frozen=True, slots=True)
class Reply:
    """One answer of a called model: its outputs, or an error (its gRPC code and message)."""

    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    code: grpc.StatusCode | None = None
    message: str = ""
    #: The response's parameters, as JSON.
    parameters: str = "{}"

    @classmethod
    def failed(cls, code: grpc.StatusCode, message: str) -> Reply:
        return cls(code=code, message=message)

    @classmethod
    def of(cls, response: pb.ModelInferResponse) -> Reply:
        outputs = {name: tensor.to_array() for name, tensor in response_tensors(response).items()}
        parameters = {}
        for key, value in response.parameters.items():
            choice = value.WhichOneof("parameter_choice")
            parameters[key] = None if choice is None else getattr(value, choice)
        return cls(outputs, parameters=json.dumps(parameters))


@dataclass(frozen=True, slots=True)
class Call:
    """What a model asks of another model."""

    model: str
    version: str
    inputs: Mapping[str, np.ndarray]
    outputs: Sequence[str]
    request_id: str = ""
    #: Microseconds the model gives the call (0: as long as its own request has).
    timeout_us: int = 0
    #: Request parameters (Triton's: strings, integers and booleans).
    parameters: Mapping[str, Any] = field(default_factory=dict)
    #: The trace context to continue (None: the calling request's).
    trace: Mapping[str, str] | None = None

    def request(self) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name=self.model, model_version=self.version, id=self.request_id)
        for name, array in self.inputs.items():
            tensor = Tensor.from_array(name, np.asarray(array))
            request.inputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
            request.raw_input_contents.append(tensor.raw)
        for name in self.outputs:
            request.outputs.add(name=name)
        for key, value in self.parameters.items():
            parameter = request.parameters[key]
            if isinstance(value, bool):
                parameter.bool_param = value
            elif isinstance(value, int):
                parameter.int64_param = value
            else:
                parameter.string_param = str(value)
        return request


class RouterCalls:
    """The service's channel to the router, on which its models' calls go. The router's address is
    `address`, or read from `port_file` (with `host`) at the first call, for a router started after the
    service on a port the OS picked. `credentials` (None: plaintext) and `token` (the router's clients'
    bearer token) go with every call."""

    def __init__(
        self,
        address: str | None,
        *,
        port_file: Path | None = None,
        host: str = "127.0.0.1",
        max_message_bytes: int = 64 * 1024 * 1024,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
    ) -> None:
        self._credentials = credentials
        self._address = address
        self._port_file = port_file
        self._host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        self._max_message_bytes = max_message_bytes
        self._auth = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GRPCInferenceServiceStub | None = None
        self._shared: _SharedStream | None = None

    @property
    def configured(self) -> bool:
        return self._address is not None or self._port_file is not None

    def _connect(self) -> pb_grpc.GRPCInferenceServiceStub:
        if self._stub is not None:
            return self._stub
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
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def infer(
        self, request: pb.ModelInferRequest, timeout: float | None, context: Mapping[str, str]
    ) -> pb.ModelStreamInferResponse:
        """One call, on the stream that carries the service's calls (one stream for them all: a message on
        it costs the router and the service less than a call of its own); `context` is the call's trace
        context and chain. The response carries the error of a call that failed."""
        stream = self._shared
        if stream is None or stream.broken:
            stream = self._shared = _SharedStream(self._connect(), self._auth)
        return await stream.infer(request, timeout, context)

    async def stream(
        self, request: pb.ModelInferRequest, timeout: float | None, metadata: Sequence[tuple[str, str]]
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """A decoupled model's responses, up to the final one (asked for even when empty)."""
        request.parameters[EMPTY_FINAL_PARAMETER].bool_param = True
        call = self._connect().ModelStreamInfer(timeout=timeout, metadata=(*metadata, *self._auth))
        try:
            await call.write(request)
            await call.done_writing()
            async for reply in call:
                yield reply
                if is_final(reply):
                    return
        finally:
            call.cancel()

    async def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


class _SharedStream:
    """One `ModelStreamInfer` call to the router that carries many requests at once, each answered by its
    id. Its deadline, trace context and chain travel in each request's parameters, as the router's own
    streams to its stages carry them (`pipeline.protocol.streams`). A call whose caller stops waiting
    (cancelled, or past its deadline) is forgotten here; the router finishes it. Once the stream ends, every
    call on it is answered UNAVAILABLE, and the next call opens a new one. A stream without calls for
    `IDLE_S` is closed, so that a stopping router is not kept waiting for it."""

    #: Seconds without calls after which the stream is closed (the next call opens another).
    IDLE_S = 0.5

    def __init__(self, stub: pb_grpc.GRPCInferenceServiceStub, auth: Sequence[tuple[str, str]]) -> None:
        self._call = stub.ModelStreamInfer(metadata=tuple(auth))
        self._waiting: dict[str, asyncio.Future[pb.ModelStreamInferResponse]] = {}
        self._writing = asyncio.Lock()
        self._ids = itertools.count()
        self.broken = False
        self._idle: asyncio.TimerHandle | None = None
        self._reader = asyncio.create_task(self._read())

    async def infer(
        self, request: pb.ModelInferRequest, timeout: float | None, context: Mapping[str, str]
    ) -> pb.ModelStreamInferResponse:
        key = f"{next(self._ids)}"
        request.id = f"{request.id}#{key}" if request.id else key
        add_hop_parameters(request, timeout, context)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[pb.ModelStreamInferResponse] = loop.create_future()
        self._waiting[request.id] = answer
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        try:
            async with asyncio.timeout(timeout):
                async with self._writing:  # NOTE: one write at a time on a stream
                    await self._call.write(request)
                return await answer
        except TimeoutError:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "Deadline Exceeded",
            ) from None
        finally:
            self._waiting.pop(request.id, None)
            if not self._waiting and not self.broken:
                self._idle = loop.call_later(self.IDLE_S, self._retire)

    def _retire(self) -> None:
        """Close an idle stream: no new call goes on it, and the router ends it once it has answered."""
        if self._waiting or self.broken:
            return
        self.broken = True
        self._done = asyncio.ensure_future(self._call.done_writing())

    async def _read(self) -> None:
        status, details = grpc.StatusCode.UNAVAILABLE, "the stream to the router ended"
        try:
            async for reply in self._call:
                answer = self._waiting.get(reply.infer_response.id)
                if answer is not None and not answer.done():
                    answer.set_result(reply)
        except grpc.aio.AioRpcError as err:
            status, details = err.code(), err.details() or details
        except asyncio.CancelledError:
            pass
        finally:
            self.broken = True
            for answer in self._waiting.values():
                if not answer.done():
                    answer.set_exception(
                        grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
                    )

    def close(self) -> None:
        self.broken = True
        if self._idle is not None:
            self._idle.cancel()
        self._call.cancel()
        self._reader.cancel()


class Responses:
    """The responses of a call to a decoupled model, as they come: `get()` waits for the next (None after the
    last); `cancel()` stops the call."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Reply | None] = queue.SimpleQueue()
        self._cancel: Callable[[], object] = lambda: None

    def get(self) -> Reply | None:
        return self._queue.get()

    def cancel(self) -> None:
        self._cancel()


class CallScope:
    """One request that an instance runs: where its model's calls go and what they carry (see the module
    docstring). Made on the event loop for every batch, so it costs nothing until a call is made; its calls
    may be made from any thread."""

    __slots__ = ("_cancelled", "_chain", "_instance", "_tasks", "deadline", "loop", "router", "trace")

    def __init__(
        self,
        router: RouterCalls | None,
        deadline: Deadline,
        chain: CallChain | None,
        instance: str,
        traced: bool,
    ) -> None:
        """`chain`: the request's own (None: a client's request); `instance`: the key of the instance that
        runs it; `traced`: whether the request's trace context is to be kept for its calls."""
        self.router = router
        self.deadline = deadline
        self._chain = chain
        self._instance = instance
        self.trace: Context | None = otel_context.get_current() if traced else None
        self.loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cancelled = False

    @property
    def chain(self) -> CallChain:
        """The chain of the calls this request's model makes."""
        return (self._chain or ROOT).nested(self._instance)

    def enter(self) -> contextvars.Token[CallScope | None]:
        """Make this the current request of the running thread (or task) until `leave`."""
        return _CURRENT.set(self)

    @staticmethod
    def leave(token: contextvars.Token[CallScope | None]) -> None:
        _CURRENT.reset(token)

    def trace_headers(self) -> dict[str, str]:
        """The calling request's W3C trace context, as `pb_utils.InferenceRequest.trace()` gives it."""
        carrier: dict[str, str] = {}
        if self.trace is not None:
            PROPAGATOR.inject(carrier, context=self.trace)
        return carrier

    # --- calls ---------------------------------------------------------------------------------------

    def submit(self, call: Call) -> concurrent.futures.Future[Reply]:
        """Send `call`; its `Reply` comes in the future (an error reply, never an exception)."""
        refused = self._refusal(call)
        if refused is not None:
            done: concurrent.futures.Future[Reply] = concurrent.futures.Future()
            done.set_result(refused)
            return done
        return self._run(self._infer(call))

    def stream(self, call: Call) -> Responses:
        """Send `call` to a decoupled model; its replies come through the `Responses`."""
        responses = Responses()
        refused = self._refusal(call)
        if refused is not None:
            responses._queue.put(refused)
            responses._queue.put(None)
            return responses
        future = self._run(self._stream(call, responses))
        # NOTE: cancelling the concurrent future cancels its task on the loop, from any thread.
        responses._cancel = future.cancel
        return responses

    def cancel(self) -> None:
        """Cancel every call in flight (the request was cancelled): each answers CANCELLED. On the loop."""
        self._cancelled = True
        for task in list(self._tasks):
            task.cancel()

    def _refusal(self, call: Call) -> Reply | None:
        where = f"call to model '{call.model}'"
        if self.router is None or not self.router.configured:
            return Reply.failed(
                grpc.StatusCode.UNAVAILABLE,
                f"{where}: this service has no router to send it to (start it with --router HOST:PORT or "
                "PIPELINE_ROUTER)",
            )
        if self.chain.depth > MAX_DEPTH:
            return Reply.failed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{where} refused: it would be nested {self.chain.depth} calls deep, more than the "
                f"{MAX_DEPTH} allowed (does a model call itself without end?)",
            )
        if self._on_loop():
            return Reply.failed(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}: made on the service's event loop (an inline model), where it could never be "
                "answered; a model that calls other models must run on its own thread (not inline)",
            )
        if self._cancelled or self.deadline.expired():
            return Reply.failed(grpc.StatusCode.CANCELLED, f"{where}: the calling request was cancelled")
        return None

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def _run(self, work: Coroutine[Any, Any, Reply]) -> concurrent.futures.Future[Reply]:
        async def tracked() -> Reply:
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            try:
                return await work
            except asyncio.CancelledError:
                return Reply.failed(grpc.StatusCode.CANCELLED, "the calling request was cancelled")
            finally:
                self._tasks.discard(task)

        return asyncio.run_coroutine_threadsafe(tracked(), self.loop)

    def _timeout(self, call: Call) -> float | None:
        remaining = self.deadline.remaining()
        own = call.timeout_us / 1e6 if call.timeout_us > 0 else None
        if remaining is None:
            return own
        return remaining if own is None else min(remaining, own)

    def _metadata(self, call: Call) -> list[tuple[str, str]]:
        trace = call.trace if call.trace is not None else self.trace_headers()
        return [*trace.items(), (CALL_CHAIN_HEADER, self.chain.header())]

    async def _infer(self, call: Call) -> Reply:
        assert self.router is not None
        context = call.trace if call.trace is not None else self.trace_headers()
        context = {**context, CALL_CHAIN_HEADER: self.chain.header()}
        try:
            reply = await self.router.infer(call.request(), self._timeout(call), context)
        except grpc.aio.AioRpcError as err:
            return Reply.failed(err.code(), err.details() or err.code().name)
        except ConnectionError as err:
            return Reply.failed(grpc.StatusCode.UNAVAILABLE, f"call to model '{call.model}': {err}")
        if reply.error_message:
            status = status_of(reply)
            return Reply.failed(_status_code(status.code), status.message)
        return Reply.of(reply.infer_response)

    async def _stream(self, call: Call, responses: Responses) -> Reply:
        assert self.router is not None
        put = responses._queue.put
        try:
            async for reply in self.router.stream(call.request(), self._timeout(call), self._metadata(call)):
                if reply.error_message:
                    status = status_of(reply)
                    put(Reply.failed(_status_code(status.code), status.message))
                else:
                    put(Reply.of(reply.infer_response))
        except grpc.aio.AioRpcError as err:
            put(Reply.failed(err.code(), err.details() or err.code().name))
        except ConnectionError as err:
            put(Reply.failed(grpc.StatusCode.UNAVAILABLE, f"call to model '{call.model}': {err}"))
        except asyncio.CancelledError:
            put(Reply.failed(grpc.StatusCode.CANCELLED, "the call was cancelled"))
            raise
        finally:
            put(None)
        return Reply()


def _status_code(number: int) -> grpc.StatusCode:
    """The `grpc.StatusCode` of a status number (UNKNOWN for one gRPC does not define)."""
    return next((code for code in grpc.StatusCode if code.value[0] == number), grpc.StatusCode.UNKNOWN)

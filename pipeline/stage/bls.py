"""Calls from inside a model to the models the pipeline serves (Triton's Business Logic Scripting).

A Python model calls another model with `pb_utils.InferenceRequest(...).exec()` (or `async_exec()`) while
its `execute` runs. The call goes to the router (`--router`): the router knows every model, stage models
and ensembles alike, and batches the call with all other traffic of the callee, so that a model that fans
out into many calls fills the callee's batches. Each call carries what its caller's request carries:

- the time the caller's request has left (and the request's own `timeout`, if shorter);
- the caller's trace context, so the call's spans sit under the caller's;
- the chain of calls it belongs to (`pipeline.protocol.call_chain`): nested too deep, it is refused; and the
  callee's stage refuses at once a call that no instance could ever run, every instance waiting on it or
  on calls like it (`pipeline.stage.pool`), instead of hanging;
- cancellation: when the caller's request is cancelled (its client went away), its calls are cancelled
  (they answer CANCELLED at once), and the router cancels them at their callees in turn, whichever
  transport carried them (`pipeline.transport.matched`).

The calls run on the service's event loop, whatever thread the model runs on (`pipeline.stage.router_link`
carries them, over the router's frame port where it has one): `exec` waits for the answer on the model's
thread, `async_exec` in the model's event loop (the service's own where its `async def execute` runs there:
`BlsScope.submit_here`). Calls made together to one batching model go as one
request of all their items (`BlsScope.submit`). What a model sees of them is in
`pipeline.stage.triton_python_backend_utils`; here they are tensors in and a `Reply` out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import json
import queue
import threading
from collections.abc import Callable, Coroutine, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import numpy as np
from opentelemetry import context as otel_context
from opentelemetry.context import Context

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.call_chain import CALL_CHAIN_HEADER, MAX_DEPTH, ROOT, CallChain
from pipeline.protocol.codec import Tensor, response_tensors
from pipeline.protocol.streams import status_of
from pipeline.protocol.tensor_batch import BatchShapeError, merge_arrays, split_arrays
from pipeline.runtime.telemetry import PROPAGATOR
from pipeline.stage.api import Deadline
from pipeline.stage.router_link import RouterClient

#: The request being run on this thread (or task), whose model may call other models.
_CURRENT: contextvars.ContextVar[BlsScope | None] = contextvars.ContextVar(
    "pipeline_model_call", default=None
)


def current() -> BlsScope | None:
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

    def split(self, sizes: Sequence[int]) -> list[Reply] | None:
        """The replies of the merged calls of `sizes` items each, or None when an output is not one row per
        item (the callee does not answer item by item)."""
        try:
            parts = split_arrays(self.outputs, sizes)
        except BatchShapeError:
            return None
        return [Reply(outputs, parameters=self.parameters) for outputs in parts]

    @classmethod
    def of(cls, response: pb.ModelInferResponse) -> Reply:
        outputs = {name: tensor.to_array() for name, tensor in response_tensors(response).items()}
        if not response.parameters:
            return cls(outputs)
        parameters = {}
        for key, value in response.parameters.items():
            choice = value.WhichOneof("parameter_choice")
            parameters[key] = None if choice is None else getattr(value, choice)
        return cls(outputs, parameters=json.dumps(parameters))


@dataclass(frozen=True, slots=True)
class BlsRequest:
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

    @property
    def size(self) -> int | None:
        """Its items: the first dimension of its inputs, where they all have the same (else None)."""
        sizes = {np.shape(array)[0] if np.ndim(array) else None for array in self.inputs.values()}
        return sizes.pop() if len(sizes) == 1 else None

    def merge_key(self) -> Hashable:
        """Calls with equal keys may go as one request of all their items (`merged`)."""
        if self.size is None:
            return id(self)
        return (
            self.model,
            self.version,
            tuple(self.outputs),
            self.request_id,
            self.timeout_us,
            json.dumps(dict(self.parameters), sort_keys=True, default=str) if self.parameters else "",
            None if self.trace is None else tuple(sorted(self.trace.items())),
            tuple(
                (name, np.asarray(a).dtype.str, np.shape(a)[1:]) for name, a in sorted(self.inputs.items())
            ),
        )

    @staticmethod
    def merged(calls: Sequence[BlsRequest]) -> BlsRequest:
        """Calls of one `merge_key` as one: their inputs concatenated along the first dimension."""
        return replace(calls[0], inputs=merge_arrays([call.inputs for call in calls]))

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


#: Where a call's `Reply` goes: the future of a model's thread (`submit`), or of the service's loop
#: (`submit_here`).
_Answer = concurrent.futures.Future[Reply] | asyncio.Future[Reply]


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


class BlsScope:
    """One request that an instance runs: where its model's calls go and what they carry (see the module
    docstring). Made on the event loop for every batch, so it costs nothing until a call is made; its calls
    may be made from any thread."""

    __slots__ = (
        "_cancelled",
        "_chain",
        "_instance",
        "_lock",
        "_nested",
        "_outbox",
        "_tasks",
        "deadline",
        "loop",
        "router",
        "trace",
    )

    def __init__(
        self,
        router: RouterClient | None,
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
        self._nested: CallChain | None = None
        self.trace: Context | None = otel_context.get_current() if traced else None
        self.loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cancelled = False
        #: Calls made and not yet taken up by the loop.
        self._outbox: list[tuple[BlsRequest, _Answer]] = []
        self._lock = threading.Lock()

    @property
    def chain(self) -> CallChain:
        """The chain of the calls this request's model makes."""
        nested = self._nested
        if nested is None:
            nested = self._nested = (self._chain or ROOT).nested(self._instance)
        return nested

    def enter(self) -> contextvars.Token[BlsScope | None]:
        """Make this the current request of the running thread (or task) until `leave`."""
        return _CURRENT.set(self)

    @staticmethod
    def leave(token: contextvars.Token[BlsScope | None]) -> None:
        _CURRENT.reset(token)

    def trace_headers(self) -> dict[str, str]:
        """The calling request's W3C trace context, as `pb_utils.InferenceRequest.trace()` gives it."""
        carrier: dict[str, str] = {}
        if self.trace is not None:
            PROPAGATOR.inject(carrier, context=self.trace)
        return carrier

    # --- calls ---------------------------------------------------------------------------------------

    def submit(self, call: BlsRequest, *, awaited: bool = False) -> concurrent.futures.Future[Reply]:
        """Send `call` from the model's thread; its `Reply` comes in the future (an error reply, never an
        exception). `awaited`: the model awaits it in an event loop of its own (`async_exec`), else it
        waits by blocking (`exec`).

        The calls a model makes without waiting in between (`async_exec` in a loop) are taken up by the
        service's loop together, with one wake-up, and those to one batching model with the same tensors
        go as one request of all their items (at most the callee's `max_batch_size`): the router's batcher
        then sees them together rather than the first alone, and every hop carries one message instead of
        many. A merged request that fails is sent again call by call, so that each gets its own answer."""
        future: concurrent.futures.Future[Reply] = concurrent.futures.Future()
        # NOTE: on the service's loop only a call that is awaited can be answered (`submit_here`).
        refused = self._refusal(call) or (self._blocking_refusal(call) if self._on_loop() else None)
        if refused is not None:
            future.set_result(refused)
        else:
            self._post(call, future, awaited)
        return future

    def submit_here(self, call: BlsRequest) -> asyncio.Future[Reply]:
        """`submit` from a coroutine on the service's loop (an `async def execute` that runs there): its
        `Reply` comes in an asyncio future of that loop, with no thread in between."""
        future: asyncio.Future[Reply] = self.loop.create_future()
        refused = self._refusal(call)
        if refused is not None:
            future.set_result(refused)
        else:
            self._post(call, future, awaited=True)
        return future

    def _post(self, call: BlsRequest, future: _Answer, awaited: bool) -> None:
        with self._lock:
            self._outbox.append((call, future))
            first = len(self._outbox) == 1
        if not awaited:
            # Its caller blocks, its own event loop too where it has one (`exec` in an async execute on the
            # instance's thread): the loop takes it up at once, with any calls made before it.
            self.loop.call_soon_threadsafe(self._flush)
        elif first:
            model_loop = asyncio.get_running_loop()
            if model_loop is self.loop:
                self.loop.call_soon(self._flush)
            else:
                # `async_exec` on the model's own loop: the calls this step of its coroutine makes (until it
                # awaits) are handed over together, whatever the threads' timing.
                model_loop.call_soon(self.loop.call_soon_threadsafe, self._flush)

    def stream(self, call: BlsRequest) -> Responses:
        """Send `call` to a decoupled model; its replies come through the `Responses`."""
        responses = Responses()
        refused = self._refusal(call) or (self._blocking_refusal(call) if self._on_loop() else None)
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

    def _refusal(self, call: BlsRequest) -> Reply | None:
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
        if self._cancelled or self.deadline.expired():
            return Reply.failed(grpc.StatusCode.CANCELLED, f"{where}: the calling request was cancelled")
        return None

    @staticmethod
    def _blocking_refusal(call: BlsRequest) -> Reply:
        """The answer to a call whose caller would block the service's loop waiting for it."""
        return Reply.failed(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"call to model '{call.model}': made on the service's event loop (an inline model, or an async "
            "execute that runs there), where a call waited for without awaiting could never be answered; a "
            "model that calls other models must run on its own thread (not inline), and an async execute "
            "must await async_exec()",
        )

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

    def _flush(self) -> None:
        """Take up the calls made since the last time, grouped by `BlsRequest.merge_key` (on the loop)."""
        with self._lock:
            pending, self._outbox = self._outbox, []
        groups: dict[Hashable, list[tuple[BlsRequest, _Answer]]] = {}
        single = len(pending) == 1  # nothing to merge with: no key to compute
        for call, future in pending:
            # False: its caller stopped waiting
            wanted = (
                not future.cancelled()
                if isinstance(future, asyncio.Future)
                else future.set_running_or_notify_cancel()
            )
            if wanted:
                groups.setdefault(None if single else call.merge_key(), []).append((call, future))
        for group in groups.values():
            task = self.loop.create_task(self._answer(group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, group: list[tuple[BlsRequest, _Answer]]) -> None:
        calls = [call for call, _ in group]
        try:
            replies = await self._send(calls)
        except asyncio.CancelledError:
            replies = [Reply.failed(grpc.StatusCode.CANCELLED, "the calling request was cancelled")] * len(
                calls
            )
        for (_, future), reply in zip(group, replies, strict=True):
            if not future.done():  # an asyncio future whose caller stopped waiting is cancelled
                future.set_result(reply)

    async def _send(self, calls: list[BlsRequest]) -> list[Reply]:
        """The replies to `calls`, merged where the callee batches."""
        assert self.router is not None
        if len(calls) == 1:
            return [await self._infer(calls[0])]
        if (limit := await self.router.max_batch_size(calls[0].model)) > 0:
            replies: list[Reply] = []
            chunk: list[BlsRequest] = []
            sizes: list[int] = []
            total = 0
            for call in [*calls, None]:
                size = 0 if call is None else call.size or 0
                if chunk and (call is None or total + size > limit):
                    replies += await self._send_merged(chunk, sizes)
                    chunk, sizes, total = [], [], 0
                if call is not None:
                    chunk.append(call)
                    sizes.append(size)
                    total += size
            return replies
        return list(await asyncio.gather(*(self._infer(call) for call in calls)))

    async def _send_merged(self, calls: list[BlsRequest], sizes: list[int]) -> list[Reply]:
        if len(calls) == 1:
            return [await self._infer(calls[0])]
        reply = await self._infer(BlsRequest.merged(calls))
        parts = None if reply.code is not None else reply.split(sizes)
        if parts is None:
            return list(await asyncio.gather(*(self._infer(call) for call in calls)))
        return parts

    def _timeout(self, call: BlsRequest) -> float | None:
        remaining = self.deadline.remaining()
        own = call.timeout_us / 1e6 if call.timeout_us > 0 else None
        if remaining is None:
            return own
        return remaining if own is None else min(remaining, own)

    def _metadata(self, call: BlsRequest) -> list[tuple[str, str]]:
        trace = call.trace if call.trace is not None else self.trace_headers()
        return [*trace.items(), (CALL_CHAIN_HEADER, self.chain.header())]

    async def _infer(self, call: BlsRequest) -> Reply:
        assert self.router is not None
        context = call.trace if call.trace is not None else self.trace_headers()
        context = {**context, CALL_CHAIN_HEADER: self.chain.header()}
        try:
            reply = await self.router.infer(call.request(), self._timeout(call), context)
        except grpc.aio.AioRpcError as err:
            return _refused(call, err.code(), err.details() or err.code().name)
        except ConnectionError as err:
            return Reply.failed(grpc.StatusCode.UNAVAILABLE, f"call to model '{call.model}': {err}")
        return Reply.of(reply)

    async def _stream(self, call: BlsRequest, responses: Responses) -> Reply:
        assert self.router is not None
        put = responses._queue.put
        try:
            async for reply in self.router.stream(call.request(), self._timeout(call), self._metadata(call)):
                if reply.error_message:
                    status = status_of(reply)
                    put(_refused(call, _status_code(status.code), status.message))
                else:
                    put(Reply.of(reply.infer_response))
        except grpc.aio.AioRpcError as err:
            put(_refused(call, err.code(), err.details() or err.code().name))
        except ConnectionError as err:
            put(Reply.failed(grpc.StatusCode.UNAVAILABLE, f"call to model '{call.model}': {err}"))
        except asyncio.CancelledError:
            put(Reply.failed(grpc.StatusCode.CANCELLED, "the call was cancelled"))
            raise
        finally:
            put(None)
        return Reply()


#: How the router's messages begin where it serves no model of that name, or no such version of it.
_NOT_SERVED = ("unknown model '{model}'", "model '{model}' has no version '")


def _refused(call: BlsRequest, code: grpc.StatusCode, message: str) -> Reply:
    """A call the router answered with an error. Where the router serves no such model (or version), the
    message begins as Triton's begins for a BLS call there, "Model 'x' is not ready" (callers match on it),
    and goes on with the router's reason; any other error is passed on as it is."""
    if code == grpc.StatusCode.NOT_FOUND and message.startswith(
        tuple(prefix.format(model=call.model) for prefix in _NOT_SERVED)
    ):
        message = f"Model '{call.model}' is not ready: {message}"
    return Reply.failed(code, message)


def _status_code(number: int) -> grpc.StatusCode:
    """The `grpc.StatusCode` of a status number (UNKNOWN for one gRPC does not define)."""
    return next((code for code in grpc.StatusCode if code.value[0] == number), grpc.StatusCode.UNKNOWN)

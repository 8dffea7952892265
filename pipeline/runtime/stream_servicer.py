"""The requests of one `ModelStreamInfer` stream, read while the stream has room and each run as a task of
its own (`StreamRequests`) by the server's `InferenceHandler`; the gRPC servicer writes their responses
(`pipeline.runtime.servicer`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import PipelineError, Unimplemented
from pipeline.protocol.sequence_line import SequenceLine, Turn
from pipeline.protocol.streams import (
    CANCEL_PARAMETER,
    EMPTY_FINAL_PARAMETER,
    add_hop_parameters,
    error_response,
    hop_context,
    wants_empty_final,
)
from pipeline.runtime.admission import CONNECTION_INFLIGHT, ModelShares, StreamHold
from pipeline.runtime.data_plane import RequestContext
from pipeline.runtime.error_status import internal_error, rpc_status_of
from pipeline.runtime.handler import InferenceHandler

#: The responses of a stream's decoupled requests held at once, past each request's first (see
#: `ModelStreamInfer`).
STREAM_INFLIGHT = 64


class StreamRequests:
    """The requests of one `ModelStreamInfer` stream: read while it has room, each run as a task of its
    own, its response put in `done` for the stream's writer. Each request takes a slot and its bytes when
    read; the writer gives them back once it has sent its response. A message with `CANCEL_PARAMETER`
    cancels the request of its `id`, as a unary call's cancellation would: it answers nothing, and gives
    back what it holds."""

    __slots__ = (
        "call",
        "closed",
        "decoupled",
        "done",
        "handler",
        "hold",
        "ids",
        "responses",
        "sequences",
        "shares",
        "slots",
        "tasks",
    )

    def __init__(self, handler: InferenceHandler, call: RequestContext) -> None:
        self.handler = handler
        self.call = call
        self.done: asyncio.Queue[tuple[pb.ModelStreamInferResponse, int, asyncio.Semaphore] | None] = (
            asyncio.Queue()
        )
        self.slots = asyncio.Semaphore(CONNECTION_INFLIGHT)
        #: A decoupled request's responses past its first, not sent yet.
        self.responses = asyncio.Semaphore(STREAM_INFLIGHT)
        self.hold = StreamHold(handler.budget, self.done, self.slots)
        self.shares = ModelShares(handler.budget)
        self.tasks: set[asyncio.Task[None]] = set()
        #: The requests running, by their `id` (those that have one), for their cancellation.
        self.ids: dict[str, asyncio.Task[None]] = {}
        self.closed = False
        self.decoupled = handler.plane.decoupled
        #: The requests of each sequence on this stream, in order: each waits for the one before it to be
        #: in line.
        self.sequences = SequenceLine()

    async def read(self, request_iterator: AsyncIterator[pb.ModelInferRequest]) -> None:
        """Start each request as it comes, while the stream has room; once the client is done and every
        request answered, put the end of the stream in `done`."""
        slots, hold, tasks, decoupled, sequences = (
            self.slots,
            self.hold,
            self.tasks,
            self.decoupled,
            self.sequences,
        )
        try:
            while True:
                await slots.acquire()
                await hold.wait_for_room()
                request = await request_iterator.__anext__()
                if request.parameters and CANCEL_PARAMETER in request.parameters:
                    slots.release()  # no request of its own
                    stopped = self.ids.get(request.id)
                    if stopped is not None:
                        stopped.cancel()
                    continue
                size = request.ByteSize()
                try:
                    self.shares.take(request.model_name, size)
                except PipelineError as err:
                    hold.put(error_response(request, err.code, err.message, rpc_status_of(err)))
                    continue
                await hold.take(size)
                if decoupled and request.model_name in decoupled:
                    task = asyncio.create_task(self.many(request, size))
                elif (turn := sequences.turn(request)) is not None:
                    # A sequence's requests go on in the order they came, each once the one before it is in
                    # line (as Triton's sequence batcher takes them); other requests run concurrently.
                    task = asyncio.create_task(self.after(turn, request, size))
                    task.add_done_callback(turn.done)
                else:
                    task = asyncio.create_task(self.one(request, size))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if request.id:
                    self.ids[request.id] = task
                    task.add_done_callback(functools.partial(_forget, self.ids, request.id))
                task.add_done_callback(functools.partial(self._answered, request.model_name, size))
        except StopAsyncIteration:
            pass
        while tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
        self.done.put_nowait(None)

    def _answered(self, model: str, size: int, _: asyncio.Task[None]) -> None:
        self.shares.free(model, size)

    async def one(self, request: pb.ModelInferRequest, size: int) -> None:
        """A request for a model that answers once: its response, or its error as a response."""
        call = self.call
        empty_final = bool(request.parameters) and wants_empty_final(request)
        timeout, metadata = hop_context(request, call.metadata)
        own = call if timeout is None and metadata is call.metadata else RequestContext(timeout, metadata)
        try:
            response = pb.ModelStreamInferResponse(infer_response=await self.handler.infer(request, own))
        except asyncio.CancelledError:
            self._dropped(size)
            raise
        except Unimplemented as err:
            if request.model_name in self.decoupled:
                # Its model was learnt to be decoupled while this request waited for it (its first
                # request, or an ensemble made available by this very request): refused before it ran, it
                # streams now, with the hop's parameters it came with (deadline, trace, final flag).
                add_hop_parameters(request, timeout, {k: v for k, v in metadata if isinstance(v, str)})
                if empty_final:
                    request.parameters[EMPTY_FINAL_PARAMETER].bool_param = True
                await self.many(request, size)
                return
            response = error_response(request, err.code, err.message, rpc_status_of(err))
        except PipelineError as err:
            response = error_response(request, err.code, err.message, rpc_status_of(err))
        except Exception:
            response = error_response(request, grpc.StatusCode.INTERNAL, internal_error(), None)
        self.hold.put(response, size)

    async def after(self, turn: Turn, request: pb.ModelInferRequest, size: int) -> None:
        """A sequence's request, once the one before it on this stream is in line."""
        try:
            await turn.wait()
        except asyncio.CancelledError:
            self._dropped(size)
            raise
        await self.one(request, size)

    def _dropped(self, size: int) -> None:
        """A request cancelled before its response: give back its slot and bytes (the stream's end gives
        back everything at once)."""
        if not self.closed:
            self.slots.release()
            self.hold.free(size)

    async def many(self, request: pb.ModelInferRequest, size: int) -> None:
        """A decoupled request. The reader took a slot and `size` bytes for it; each response after its
        first takes one of the stream's `responses`, which the writer gives back once it has sent it (the
        request's bytes and slot go back with its first response)."""
        responses, hold = self.responses, self.hold
        sent = 0

        async def send(reply: pb.ModelStreamInferResponse) -> None:
            nonlocal sent
            if sent:
                await responses.acquire()
                hold.put(reply, 0, responses)
            else:
                hold.put(reply, size)
            sent += 1

        try:
            await self.handler.stream(request, self.call, send)
        finally:
            if not sent:
                self._dropped(size)

    def close(self) -> None:
        """The stream ended (or its client went): cancel what still runs, give back what it holds."""
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        self.hold.close()


def _forget(tasks: dict[str, asyncio.Task[None]], key: str, done: asyncio.Task[None]) -> None:
    """Drop a finished request of an id unless a later one of it came since."""
    if tasks.get(key) is done:
        del tasks[key]

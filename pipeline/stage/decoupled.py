"""Decoupled models: any number of responses to one request, each sent as soon as it is made.

A model is decoupled when its config says `model_transaction_policy { decoupled: true }`, as in Triton: a
`TritonPythonModel` that answers through `request.get_response_sender()` (`pipeline.stage.triton_model`), or
a `Stage` whose `infer` is a generator or an async generator, each yield a response
(`pipeline.stage.backend.StageInstance`). It is served on `ModelStreamInfer`; `ModelInfer`
refuses it, as Triton does.

The model makes its responses on its instance's thread (or on any thread a Triton model starts); a
`ResponseChannel` carries them to the event loop and holds at most `BUFFERED` of one request unread, so a
model that makes them faster than its client reads them waits in its send. When the client goes (it
cancels, closes its stream, or its deadline passes) the channel closes: a generator stage is closed at its
next yield (within one response), a Triton model's `is_cancelled()` turns true and what it still sends is
dropped, and the instance takes the next request as soon as the model's call returns.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping

import grpc
import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import DeadlineExceeded, PipelineError, StageError
from pipeline.protocol.streams import error_response, set_final
from pipeline.runtime.error_status import internal_error, rpc_status_of
from pipeline.runtime.model_statistics import ModelStats
from pipeline.stage.api import Deadline
from pipeline.stage.bls import BlsScope
from pipeline.stage.pool import InstancePool, Slot

log = logging.getLogger(__name__)

#: Responses of one request held between the model and its client, unread.
BUFFERED = 4

#: One response: its outputs, or its error (neither: the final flag alone), and whether it is the last.
Reply = tuple[Mapping[str, np.ndarray] | None, PipelineError | None, bool]


class ResponseChannel:
    """One request's responses, from the threads that make them to the event loop that sends them.

    `send` is called on the model's threads, never on the event loop's; the other methods on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: Deadline, limit: int = BUFFERED) -> None:
        self._loop = loop
        self._deadline = deadline
        self._limit = limit
        self._space = threading.Semaphore(limit)
        self._replies: asyncio.Queue[Reply] = asyncio.Queue()
        #: Nobody reads the responses any more (written on the loop, read by the model's threads).
        self.closed = False
        #: The final flag has been sent.
        self.finished = False

    def send(
        self,
        outputs: Mapping[str, np.ndarray] | None,
        error: PipelineError | None = None,
        final: bool = False,
    ) -> bool:
        """Hand one response to the loop, waiting while `limit` are unread; False once nobody reads them."""
        if self.closed or self.finished:
            return False
        self._space.acquire()
        if self.closed:
            return False
        self.finished = final
        try:
            self._loop.call_soon_threadsafe(self._replies.put_nowait, (outputs, error, final))
        except RuntimeError:  # the loop has closed: nobody reads any more
            return False
        return True

    def cancelled(self) -> bool:
        """Whether the client has gone or the request's deadline has passed (what `is_cancelled` says)."""
        return self.closed or self._deadline.expired()

    async def get(self) -> Reply:
        """The next response, once it is made."""
        reply = await self._replies.get()
        self._space.release()
        return reply

    def fail(self, error: PipelineError) -> None:
        """End the request with `error`, unless its final flag was sent (on the loop)."""
        if not self.finished:
            self.finished = True
            self._replies.put_nowait((None, error, True))

    def close(self) -> None:
        """Nobody reads the responses any more: wake a model waiting to send, and drop what it sends."""
        if not self.closed:
            self.closed = True
            self._deadline.cancelled = True
            for _ in range(self._limit):
                self._space.release()


async def replies(
    pool: InstancePool,
    arrays: dict[str, np.ndarray],
    deadline: Deadline,
    scope_of: Callable[[Slot], BlsScope] | None = None,
) -> AsyncIterator[Reply]:
    """Run one request on an idle instance of a decoupled version and yield its responses as they come,
    up to the final one. Closing the iterator early (the client has gone) closes the channel, and cancels
    the calls its model made to other models (`scope_of` gives where they go, for the instance that runs
    it); the instance goes back to the pool when the model's call returns."""
    loop = asyncio.get_running_loop()
    channel = ResponseChannel(loop, deadline)
    timer = None
    remaining = deadline.remaining()
    if remaining is not None:
        timer = loop.call_later(remaining, _expire, channel)
    slot = await pool.take()
    scope = None if scope_of is None else scope_of(slot)
    try:
        assert slot.executor is not None, "a decoupled instance runs on a thread of its own"
        running = loop.run_in_executor(slot.executor, slot.run_decoupled, arrays, deadline, channel, scope)
    except BaseException:
        pool.give(slot)
        raise

    def returned(future: asyncio.Future[None]) -> None:
        pool.give(slot)
        if future.cancelled():
            channel.fail(StageError("the model's call was cancelled", grpc.StatusCode.CANCELLED))
            return
        error = future.exception()
        if isinstance(error, PipelineError):
            channel.fail(error)
        elif error is not None:
            channel.fail(StageError(internal_error(error), grpc.StatusCode.INTERNAL))

    running.add_done_callback(returned)
    try:
        while True:
            reply = await channel.get()
            yield reply
            if reply[2]:
                return
    finally:
        if timer is not None:
            timer.cancel()
        channel.close()
        if scope is not None:
            scope.cancel()


async def stream_replies(
    pool: InstancePool,
    request: pb.ModelInferRequest,
    arrays: dict[str, np.ndarray],
    deadline: Deadline,
    encode: Callable[[Mapping[str, np.ndarray]], pb.ModelInferResponse],
    stats: ModelStats | None = None,
    scope_of: Callable[[Slot], BlsScope] | None = None,
) -> AsyncIterator[pb.ModelStreamInferResponse]:
    """`replies` as the stream's responses: `encode` makes each response of outputs; an error is a response
    of its own (its status as `pipeline.protocol.streams` carries it), a final flag alone an empty one. Each
    is counted in `stats` by its index (`ModelStats.response_done`)."""
    index, since = 0, time.perf_counter_ns()
    async for outputs, error, final in replies(pool, arrays, deadline, scope_of):
        made = time.perf_counter_ns()
        if error is not None:
            reply = error_response(request, error.code, error.message, rpc_status_of(error))
        elif outputs is None:
            empty = pb.ModelInferResponse(
                model_name=request.model_name, model_version=request.model_version, id=request.id
            )
            reply = pb.ModelStreamInferResponse(infer_response=empty)
        else:
            reply = pb.ModelStreamInferResponse(infer_response=encode(outputs))
        if stats is not None:
            if error is not None:
                stats.response_failed(index, made - since)
            else:
                output_ns = time.perf_counter_ns() - made
                stats.response_done(index, infer_ns=made - since, output_ns=output_ns, empty=outputs is None)
        index, since = index + 1, made
        yield set_final(reply, final)


def count_stream(stats: ModelStats, items: int, elapsed_ns: int, failed: bool) -> None:
    """Count one streamed request in its model's statistics: one execution, taking it whole."""
    if failed:
        stats.request_failed(elapsed_ns)
        return
    stats.request_done(items=items, total_ns=elapsed_ns, compute_ns=elapsed_ns)
    stats.batch_done(items, elapsed_ns)


def _expire(channel: ResponseChannel) -> None:
    channel.fail(DeadlineExceeded("deadline exceeded while the model was sending its responses"))
    channel.close()

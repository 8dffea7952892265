"""The REST codec's heavy work off the router's event loop: a few worker processes, bounded.

The router's event loop serves gRPC as well as HTTP. Decompressing and parsing a request body's JSON, and
writing a response's JSON, take seconds for tens of megabytes and hold Python's GIL all along: in a thread
they would stall the loop just the same. So a request body that is compressed, or whose JSON is large, is
decompressed, parsed and made a `ModelInferRequest` in a worker process, and a response whose JSON outputs
are large is written in one: the loop only moves bytes (the body as sent, the protobuf serialisations, the
payload). Small bodies and responses are handled on the loop, where a worker's round trip would cost more
than the work.

The pool is bounded: `processes` workers, each handling one request at a time; the others wait their turn
holding their body as sent (compressed, within the size limit), never what it decodes to, which is where
the memory goes (60 MB of JSON strings are 600 MB of Python objects). A worker starts with the first
request that needs it and stays. Each worker is a process of its own with a pipe of its own: one that dies
(killed for memory) fails the request it held and no other; one found dead while idle is started anew
before a request is sent to it. With `processes` 0 everything is done on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import Unavailable
from pipeline.router.frontdoor.rest_codec import (
    OutputForm,
    check_json_size,
    decompressed,
    infer_request,
    infer_response_body,
    json_object,
    json_part_size,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Request JSON and response JSON outputs up to this many bytes are handled on the loop: parsing or
#: writing 64 KB of JSON takes about a millisecond.
INLINE_BYTES = 64 * 1024
#: The name of the workers' processes (`ps`, `multiprocessing.active_children()`).
WORKER_NAME = "pipeline-http-codec"
#: How much nicer than the router its workers run (`nice(1)`): the scheduler gives them what the event
#: loop leaves.
WORKER_NICENESS = 10
#: How long closing the pool waits for an idle worker to exit before it is killed.
_EXIT_WAIT_S = 5.0


class WorkerDied(Exception):
    """The worker process ended while it held a call."""


class _Worker:
    """One worker process and the pipe to it; used by one call at a time (`CodecPool` hands it out)."""

    def __init__(self) -> None:
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None

    def call(self, work: Callable[..., T], args: tuple[Any, ...]) -> T:
        """`work(*args)` in the worker, started anew first when it is not running. Blocks: run in a thread.
        Raises what `work` raised, or `WorkerDied`."""
        if self._process is None or not self._process.is_alive():
            self._start()
        assert self._conn is not None
        try:
            self._conn.send((work, args))
        except (BrokenPipeError, ConnectionResetError):  # it died before taking the call: start it anew
            self._start()
            self._conn.send((work, args))
        try:
            ok, result = self._conn.recv()
        except (EOFError, ConnectionResetError):
            self.stop(wait=0)
            raise WorkerDied from None
        if not ok:
            raise result
        return result

    def _start(self) -> None:
        self.stop(wait=0)
        context = multiprocessing.get_context("spawn")  # NOTE: never fork a process that runs gRPC
        ours, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(theirs,), name=WORKER_NAME, daemon=True)
        process.start()
        theirs.close()  # so that the worker's end closing (its exit) reads as EOF here
        self._process, self._conn = process, ours

    def stop(self, wait: float) -> None:
        """Close the pipe (an idle worker exits on it), wait up to `wait` s for the process, then kill it."""
        process, conn, self._process, self._conn = self._process, self._conn, None, None
        if conn is not None:
            conn.close()
        if process is not None:
            process.join(wait)
            if process.is_alive():
                process.kill()
                process.join()
            process.close()

    def kill(self) -> None:
        """Kill the process of a worker whose call is under way: that call ends with `WorkerDied`."""
        with contextlib.suppress(ValueError):  # its call ended meanwhile, and closed it
            if self._process is not None:
                self._process.kill()


class CodecPool:
    """Worker processes for the REST codec's large bodies and responses, and the turns to use them."""

    def __init__(self, processes: int = 2) -> None:
        """`processes`: how many workers, and requests handled by them at once; 0 for none (all on the
        loop)."""
        self.processes = processes
        self._workers = [_Worker() for _ in range(processes)]
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for worker in self._workers:
            self._idle.put_nowait(worker)
        self._busy: dict[_Worker, asyncio.Future[Any]] = {}  # each worker at work, and its call

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` (a module-level function, its arguments and result picklable) in a worker, once
        one is free; UNAVAILABLE when the worker dies meanwhile. On the loop when the pool has none."""
        if not self._workers:
            return work(*args)
        worker = await self._idle.get()
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(None, worker.call, work, args)
        self._busy[worker] = call
        # NOTE: the worker is free again when its call ends, not when this request does: a request
        # cancelled meanwhile must not hand another one a worker that is still busy (its answer pending).
        call.add_done_callback(lambda _: self._freed(worker, call))
        try:
            return await asyncio.shield(call)
        except WorkerDied:
            log.warning("an HTTP codec worker process died with a request; it starts anew with the next")
            raise Unavailable(
                "the worker process decoding or encoding this request died (out of memory?); retry, or send "
                "it smaller or as binary data"
            ) from None

    def _freed(self, worker: _Worker, call: asyncio.Future[Any]) -> None:
        del self._busy[worker]
        self._idle.put_nowait(worker)
        if not call.cancelled():
            call.exception()  # retrieved here too: the request that awaited it may have gone

    async def _maybe_run(self, offload: bool, work: Callable[..., T], *args: Any) -> T:
        return await self.run(work, *args) if offload else work(*args)

    async def infer_request(
        self, body: bytes, encoding: str, header_length: str | None, model: str, version: str, limit: int
    ) -> tuple[pb.ModelInferRequest, OutputForm]:
        """A REST inference request's body as sent (`encoding` as `rest_codec.check_encoding` returns it)
        as a `ModelInferRequest` and its outputs' form, in a worker when it is compressed or its JSON is
        large; the body decompresses to, and its inputs hold, at most `limit` bytes."""
        offload = bool(encoding) or json_part_size(len(body), header_length) > INLINE_BYTES
        serialized, form = await self._maybe_run(
            offload, decode_infer, body, encoding, header_length, model, version, limit
        )
        return pb.ModelInferRequest.FromString(serialized), form

    async def json_body(self, body: bytes, encoding: str, limit: int) -> dict[str, Any]:
        """A request body that is a JSON object (the repository endpoints'), parsed as `infer_request`
        parses one."""
        offload = bool(encoding) or len(body) > INLINE_BYTES
        return await self._maybe_run(offload, decode_json, body, encoding, limit)

    async def infer_response(
        self, response: pb.ModelInferResponse, form: OutputForm, max_json_bytes: int
    ) -> tuple[bytes, int | None]:
        """A `ModelInferResponse` as a REST body (`rest_codec.infer_response_body`), written in a worker
        when its JSON outputs are large; refused before it travels there when they are too large."""
        if check_json_size(response, form, max_json_bytes) <= INLINE_BYTES:
            return infer_response_body(response, form, max_json_bytes)
        return await self.run(encode_infer, response.SerializeToString(), form, max_json_bytes)

    async def aclose(self) -> None:
        """Stop the workers: idle ones exit, a busy one (its request cancelled in the drain) is killed."""
        for worker in self._busy:
            worker.kill()
        await asyncio.gather(*self._busy.values(), return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(worker.stop, _EXIT_WAIT_S) for worker in self._workers))


# --- what the workers run ------------------------------------------------------------------------------


def _serve(conn: Connection) -> None:
    """A worker's loop: each `(work, args)` received, its result or exception sent back; until the pipe
    closes."""
    # Ctrl-C reaches the whole process group, and the router, not its workers, stops on it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Below the router's priority: where the cores are few, its event loop runs as soon as it has work.
    os.nice(WORKER_NICENESS)
    while True:
        try:
            work, args = conn.recv()
        except EOFError:
            return
        try:
            reply: tuple[bool, Any] = (True, work(*args))
        except Exception as err:  # the caller raises it, as if the work had run there
            reply = (False, err)
        try:
            conn.send(reply)
        except Exception as err:  # an exception that does not pickle
            with contextlib.suppress(Exception):
                conn.send((False, RuntimeError(f"{type(err).__name__}: {err}")))


def decode_infer(
    body: bytes, encoding: str, header_length: str | None, model: str, version: str, limit: int
) -> tuple[bytes, OutputForm]:
    """A request body, decompressed and parsed: its `ModelInferRequest` serialised, and its outputs' form."""
    request, form = infer_request(decompressed(body, encoding, limit), header_length, model, version, limit)
    return request.SerializeToString(), form


def decode_json(body: bytes, encoding: str, limit: int) -> dict[str, Any]:
    """A request body, decompressed and parsed as a JSON object."""
    return json_object(decompressed(body, encoding, limit), "request body")


def encode_infer(serialized: bytes, form: OutputForm, max_json_bytes: int) -> tuple[bytes, int | None]:
    """A serialised `ModelInferResponse` as a REST body."""
    return infer_response_body(pb.ModelInferResponse.FromString(serialized), form, max_json_bytes)

"""A server's frame port (`pipeline.protocol.frames`): inference requests in frames on a stream of their own.

Each request goes through the server's `InferenceHandler` (`pipeline.runtime.handler`: its span, metrics,
statistics and shared memory), as a gRPC request does: this is a door, which only translates frames to it. A connection holds at most `CONNECTION_INFLIGHT`
requests at once, answered or not, and its bytes count in the server's budget of bytes in flight
(`pipeline.runtime.admission`): a caller that stops reading its responses is not read from either. The
requests of one model hold at most their share of both (`ModelShares`): past it, a request of that model is
answered UNAVAILABLE at once and the connection goes on reading, so a model whose requests wait (a slow one, a
stuck one, a flood) never holds up the others on the same connection.

A `CANCEL` frame cancels the request it names, as gRPC's cancellation does a unary call's: the request
answers nothing, and its model's instance and the calls the model made are freed down the chain.

A server with TLS takes frames with the same TLS as gRPC (`tls`: its certificate, and with `--tls-ca` client
certificates required and verified), never in plaintext. A connection's first frame is a `HELLO`, which the
server answers: with an error where its access policy asks for credentials and neither the hello's bearer
token nor the connection's client certificate may infer (then it closes the connection), as gRPC refuses a
call (`AccessPolicy.scope`).

A door (`door`: the router's frame port for its compiled front, `pipeline.router.front`) takes the
connections whose hello carries its secret, and checks each request's own credentials instead, as gRPC
checks each call's: the caller's `authorization` and the identities of its verified client certificate
travel in the request's parameters (`AUTHORIZATION`, `IDENTITIES_PARAMETER`), which the front always sets.
Its connections carry every client's requests, so a request past the budget of bytes in flight is refused
(UNAVAILABLE) as gRPC's door refuses it, where a stage's connection waits. Each answer of a model whose
requests the front may merge says so (`FRONT_BATCH_PARAMETER`, `DataPlane.front_batch`); a merged request
says how many it carries (`MERGED_PARAMETER`), and where it fails with an error one of them may have caused,
its answer asks the front to send each alone (`RESEND_PARAMETER`).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import ssl
from collections.abc import Callable, Coroutine

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import PipelineError, Unavailable
from pipeline.protocol.frames import (
    AUTHORIZATION,
    CANCEL,
    CANCELS_PARAMETER,
    DOOR_PARAMETER,
    FRONT_BATCH_PARAMETER,
    HELLO,
    IDENTITIES_PARAMETER,
    MERGED_PARAMETER,
    REQUEST,
    RESEND_CODES,
    RESEND_PARAMETER,
    RESPONSE,
    int64_parameter,
    parse,
    stream_response,
)
from pipeline.protocol.sequence_line import SequenceLine, Turn
from pipeline.protocol.streams import error_response, hop_context
from pipeline.runtime.admission import CONNECTION_INFLIGHT, ModelShares
from pipeline.runtime.data_plane import RequestContext
from pipeline.runtime.error_status import internal_error, rpc_status_of
from pipeline.runtime.handler import InferenceHandler
from pipeline.runtime.security import (
    UNAUTHENTICATED_MESSAGE,
    AccessPolicy,
    certificate_names,
    server_ssl_context_of,
)
from pipeline.runtime.server_settings import Limits, Listening, Security
from pipeline.transport.frame_protocol import FrameProtocol

log = logging.getLogger(__name__)


class FrameServer:
    """Takes frames on a port and answers them through `handler`, with its access policy; with `tls` (the
    server's TLS, `server_ssl_context`), over TLS only."""

    def __init__(
        self,
        handler: InferenceHandler,
        *,
        max_frame_bytes: int,
        tls: ssl.SSLContext | None = None,
        door: str | None = None,
        address: tuple[str, int] = ("127.0.0.1", 0),
        reuse_port: bool = False,
    ) -> None:
        """`door`: the secret of a door's hello (its requests then carry their callers' credentials);
        `address` (host, port: 0 for one the OS picks) and `reuse_port` (shared with other processes, the
        router's workers): where `open` listens."""
        self.handler = handler
        self.max_frame_bytes = max_frame_bytes
        self.policy = handler.policy
        self.tls = tls
        self.door = door
        self.address = address
        self.reuse_port = reuse_port
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[asyncio.Task[None], FrameProtocol] = {}
        #: The requests being answered, on every connection.
        self._answering: set[asyncio.Task[None]] = set()
        self._closing = False
        self.port: int | None = None
        #: The serialized `FRONT_BATCH_PARAMETER` of each limit, appended to a door's answers.
        self._front_batches: dict[int, bytes] = {}

    async def open(self, port: int) -> int:
        """Listen at `address` (a server's door, `pipeline.runtime.lifecycle.Door`): where it is not a door's
        port, the handler names it in `ServerMetadata`. Returns the server's public port, `port`."""
        host, listen = self.address
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._connection, host, listen, ssl=self.tls, reuse_port=self.reuse_port or None
        )
        self.port = self._server.sockets[0].getsockname()[1]
        if self.door is None:
            self.handler.frames_port = self.port
        return port

    async def close(self, grace: float) -> None:
        """Stop listening and refuse new requests (UNAVAILABLE, not started: a router sends them to another
        replica); the requests in flight get `grace` seconds; then every connection closes, idle or not."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        if self._answering:
            _, late = await asyncio.wait(self._answering, timeout=grace)
            for task in late:
                task.cancel()
        for frames in self._connections.values():
            frames.close()  # its reader sees the end of the stream
        await asyncio.gather(*self._answering, *self._connections, return_exceptions=True)

    def _connection(self) -> FrameProtocol:
        return _Connection(self.max_frame_bytes, self._connected)

    async def _connected(self, frames: FrameProtocol) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = frames
        try:
            await self._serve(frames)
        except (ConnectionError, EOFError):
            pass  # the caller went away, or the server closed the connection
        finally:
            del self._connections[task]
            frames.close()
            await frames.closed

    async def _hello(self, frames: FrameProtocol) -> bool:
        """Answer the connection's `HELLO`: welcome (saying that it takes `CANCEL` frames), or refuse a
        caller that may not infer; whether it was welcome."""
        kind, payload = await frames.read()
        if kind != HELLO:
            raise ConnectionError("a frame connection must begin with a HELLO")
        hello = parse(pb.ModelInferRequest, payload)
        if not self._welcome(hello, frames):
            refusal = error_response(hello, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE, None)
            frames.write(RESPONSE, refusal.SerializeToString())
            return False
        welcome = pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(id=hello.id))
        welcome.infer_response.parameters[CANCELS_PARAMETER].bool_param = True
        frames.write(RESPONSE, welcome.SerializeToString())
        return True

    async def _serve(self, frames: FrameProtocol) -> None:
        if not await self._hello(frames):
            return
        kind, payload = await frames.read()
        slots = asyncio.Semaphore(CONNECTION_INFLIGHT)
        shares = ModelShares(self.handler.budget)
        tasks: set[asyncio.Task[None]] = set()
        #: The requests being answered, by their ids on this connection (for `CANCEL`).
        ids: dict[str, asyncio.Task[None]] = {}
        #: Each sequence's requests go on in the order they came, each once the one before it is in line.
        sequences = SequenceLine()
        try:
            while True:
                if kind == CANCEL:  # read however many requests it holds: it frees what it stops
                    stopped = ids.get(bytes(payload).decode(errors="replace"))
                    if stopped is not None:
                        stopped.cancel()
                    kind, payload = await frames.read()
                    continue
                if kind != REQUEST:
                    raise ConnectionError(f"unexpected frame kind {kind}")
                await slots.acquire()
                size = len(payload)
                request = parse(pb.ModelInferRequest, payload)
                del payload
                refusal = await self._admit(request, size, shares)
                if refusal is not None:
                    slots.release()
                    frames.write(RESPONSE, _refused(request, refusal))
                    kind, payload = await frames.read()
                    continue
                turn = sequences.turn(request)
                task = asyncio.create_task(self._answer(request, size, frames, (slots, shares), turn))
                if turn is not None:
                    task.add_done_callback(turn.done)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                ids[request.id] = task
                task.add_done_callback(functools.partial(_forget, ids, request.id))
                self._answering.add(task)
                task.add_done_callback(self._answering.discard)
                del request
                kind, payload = await frames.read()
        except EOFError:
            # The caller has sent all it will: answer what it sent, then close.
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()

    def _welcome(self, hello: pb.ModelInferRequest, frames: FrameProtocol) -> bool:
        """Whether a connection's hello may go on: a door's carries its secret; another's, credentials that
        may infer where the access policy asks for them (its bearer token, its client certificate)."""
        parameters = hello.parameters
        if self.door is not None:
            presented = parameters[DOOR_PARAMETER].string_param if DOOR_PARAMETER in parameters else ""
            return hmac.compare_digest(presented.encode(), self.door.encode())
        metadata: tuple[tuple[str, str | bytes], ...] = ()
        if AUTHORIZATION in parameters:
            metadata = ((AUTHORIZATION, parameters[AUTHORIZATION].string_param),)
        assert frames.transport is not None
        names = certificate_names(frames.transport.get_extra_info("peercert"))
        return not self.policy.enabled or self.policy.scope(metadata, names) is not None

    async def _admit(
        self, request: pb.ModelInferRequest, size: int, shares: ModelShares
    ) -> PipelineError | None:
        """Take what a request holds (its model's share, its bytes in the budget), or say why it is refused:
        a door's request without credentials that may infer, or past the budget."""
        try:
            if self.door is not None:
                _check_caller(request, self.policy)
            shares.take(request.model_name, size)
        except PipelineError as err:
            return err
        budget = self.handler.budget
        if self.door is None:
            await budget.wait(size)  # not read further until its bytes fit
            return None
        try:
            budget.admit(size)
        except PipelineError as err:
            shares.free(request.model_name, size)
            return err
        return None

    async def _answer(
        self,
        request: pb.ModelInferRequest,
        size: int,
        frames: FrameProtocol,
        held: tuple[asyncio.Semaphore, ModelShares],
        turn: Turn | None,
    ) -> None:
        budget = self.handler.budget
        model, taken = request.model_name, size
        try:
            if turn is not None:
                await turn.wait()
            timeout, metadata = hop_context(request, ())
            requests = _merged(request) if self.door is not None else 1
            limit = self.handler.plane.front_batch(model) if self.door is not None else 0
            try:
                if self._closing:
                    raise Unavailable("the server is shutting down")
                reply = await self.handler.infer(
                    request, RequestContext(timeout, metadata, requests, limit > 0)
                )
                extra = self._front_batch(limit)
                answer: tuple[bytes, ...] = stream_response(reply, extra)
            except PipelineError as err:
                answer = (_refused(request, err, requests),)
            except Exception:
                internal = error_response(request, grpc.StatusCode.INTERNAL, internal_error(), None)
                answer = (_resend(internal, grpc.StatusCode.INTERNAL, requests).SerializeToString(),)
            answered = sum(map(len, answer))
            budget.charge(answered)
            size += answered
            frames.write(RESPONSE, *answer)
            await frames.drain()
        finally:
            budget.release(size)
            held[1].free(model, taken)
            held[0].release()

    def _front_batch(self, limit: int) -> bytes:
        """The parameter that tells the front it may merge `limit` items of a model's requests (none: b"")."""
        if not limit:
            return b""
        entry = self._front_batches.get(limit)
        if entry is None:
            entry = self._front_batches[limit] = int64_parameter(FRONT_BATCH_PARAMETER, limit)
        return entry


def _merged(request: pb.ModelInferRequest) -> int:
    """How many requests a door's request carries (the front's `MERGED_PARAMETER`, taken off it)."""
    parameters = request.parameters
    if MERGED_PARAMETER not in parameters:
        return 1
    count = parameters[MERGED_PARAMETER].int64_param
    del parameters[MERGED_PARAMETER]
    return max(1, count)


def _resend(
    response: pb.ModelStreamInferResponse, code: grpc.StatusCode, requests: int
) -> pb.ModelStreamInferResponse:
    """`response` to a failed request, asking the front to send again alone each of the `requests` it
    merged, where `code` is an error one of them may have caused."""
    if requests > 1 and code in RESEND_CODES:
        response.infer_response.parameters[RESEND_PARAMETER].bool_param = True
    return response


def _forget(tasks: dict[str, asyncio.Task[None]], key: str, done: asyncio.Task[None]) -> None:
    """Drop a request's task once it is done, unless a later request of the same id came since."""
    if tasks.get(key) is done:
        del tasks[key]


class _Unauthenticated(PipelineError):
    code = grpc.StatusCode.UNAUTHENTICATED


def _check_caller(request: pb.ModelInferRequest, policy: AccessPolicy) -> None:
    """Check the credentials a door's request carries (taken off it), as gRPC checks a call's: raises
    `_Unauthenticated` where the access policy asks for credentials and they may not infer."""
    parameters = request.parameters
    token = parameters[AUTHORIZATION].string_param if AUTHORIZATION in parameters else ""
    names = parameters[IDENTITIES_PARAMETER].string_param if IDENTITIES_PARAMETER in parameters else ""
    for key in (AUTHORIZATION, IDENTITIES_PARAMETER):
        if key in parameters:
            del parameters[key]
    metadata = ((AUTHORIZATION, token),) if token else ()
    if policy.enabled and policy.scope(metadata, filter(None, names.split("\n"))) is None:
        raise _Unauthenticated(UNAUTHENTICATED_MESSAGE)


def _refused(request: pb.ModelInferRequest, err: PipelineError, requests: int = 1) -> bytes:
    """The response frame's payload of a request (carrying `requests` merged ones) that failed with `err`."""
    response = error_response(request, err.code, err.message, rpc_status_of(err))
    return _resend(response, err.code, requests).SerializeToString()


def frame_server_of(
    handler: InferenceHandler,
    listening: Listening,
    limits: Limits,
    security: Security,
    *,
    reuse_port: bool = False,
) -> FrameServer | None:
    """A server's frame port where `--frames-port` says, unless it is off: with the TLS of the server's gRPC
    port where it has TLS (the same settings), client certificates and all, and its handler's access policy."""
    if listening.frames_port is None:
        return None
    return FrameServer(
        handler,
        max_frame_bytes=limits.max_message_bytes,
        tls=server_ssl_context_of(security),
        address=(listening.host, listening.frames_port),
        reuse_port=reuse_port,
    )


class _Connection(FrameProtocol):
    """A connection to the frame port, served by a task of its own from the moment it is made."""

    def __init__(self, max_frame_bytes: int, serve: Callable[[FrameProtocol], Coroutine[None, None, None]]):
        super().__init__(max_frame_bytes)
        self._serve = serve

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.task = asyncio.get_running_loop().create_task(self._serve(self))

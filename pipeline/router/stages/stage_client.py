"""The router's client of one stage service: its calls, their retries and the mapping of their errors.

A stage is any server that speaks the Open Inference Protocol. Its replicas, their channels and health,
and the choice of one for each call are `pipeline.router.stages.replicas`; which calls are sent again, and how
many, `pipeline.router.stages.retry`. Its failures become the router's errors
(`Unavailable` naming the stage and its address, `DeadlineExceeded`, `StageError` with the stage's code),
and a call that finds a replica gone is retried on another within the request's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Mapping, Sequence

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import ModelSignature, StageEndpoint
from pipeline.protocol.errors import (
    ERROR_DOMAIN,
    NOT_STARTED,
    DeadlineExceeded,
    ItemError,
    StageError,
    Unavailable,
)
from pipeline.protocol.sequences import SEQUENCE_ID, SequenceId, sequence_of
from pipeline.protocol.streams import is_final
from pipeline.router.stages import stage_models
from pipeline.router.stages.replicas import DOWN, SERVING, Replica, Replicas
from pipeline.router.stages.retry import RetryBudget, StageRetry
from pipeline.router.stages.sequence_placement import SequencePlacement, not_known
from pipeline.router.stages.targets import Resolve
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.security import ClientTls, bearer_metadata
from pipeline.transport import ConnectionRecycled

log = logging.getLogger(__name__)


def not_started(err: grpc.aio.AioRpcError) -> bool:
    """Whether a stage's UNAVAILABLE says, in its `google.rpc.Status` details, that it did not start the call."""
    try:
        status = rpc_status.from_call(err)
    except ValueError:
        return False
    if status is None:
        return False
    info = error_details_pb2.ErrorInfo()
    return any(
        detail.Unpack(info) and info.reason == NOT_STARTED and info.domain == ERROR_DOMAIN
        for detail in status.details
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)
    )


def item_errors(err: grpc.aio.AioRpcError) -> tuple[ItemError, ...]:
    """The refused items a stage names in its error's `google.rpc.BadRequest` details (`TENSOR[i]` fields)."""
    try:
        status = rpc_status.from_call(err)
    except ValueError:
        return ()
    if status is None:
        return ()
    found = []
    bad = error_details_pb2.BadRequest()
    for detail in status.details:
        if not (detail.Is(error_details_pb2.BadRequest.DESCRIPTOR) and detail.Unpack(bad)):
            continue
        for violation in bad.field_violations:
            item = ItemError.from_field(violation.field, violation.description)
            if item is not None:
                found.append(item)
    return tuple(found)


def model_of(request: object) -> tuple[str, str]:
    """The model (and version) a call is for, which the replica it goes to must serve: `ModelInfer`'s, or that
    of `ModelReady`, `ModelMetadata` and `ModelConfig`; ("", "") for a call about the server."""
    if isinstance(request, pb.ModelInferRequest):
        return request.model_name, request.model_version
    if isinstance(request, (pb.ModelReadyRequest, pb.ModelMetadataRequest, pb.ModelConfigRequest)):
        return request.name, request.version
    return "", ""


class StageClient:
    """One stage endpoint: its replicas (`pipeline.router.stages.replicas`: a channel each, load-aware picking),
    one bounded retry layer, and the mapping of its failures to router errors."""

    def __init__(
        self,
        endpoint: StageEndpoint,
        *,
        max_message_bytes: int,
        metrics: Metrics | None = None,
        tls: ClientTls | None = None,
        retry: StageRetry | None = None,
        budget: RetryBudget | None = None,
        resolve: Resolve | None = None,
        resolve_interval: float | None = None,
        token: str | None = None,
    ) -> None:
        """`tls`: the TLS of its calls, gRPC and frames alike; `token`: the router's own bearer token for
        stages that ask for one (sent with every call)."""
        self.endpoint = endpoint
        self.metrics = metrics
        self.retry = retry or StageRetry()
        self.budget = budget or RetryBudget()
        self._auth = bearer_metadata(token)
        self._max_message_bytes = max_message_bytes
        #: The stage's replicas: their channels, health and load.
        self.replicas = Replicas(
            endpoint.name,
            endpoint.address,
            max_message_bytes=max_message_bytes,
            retry=self.retry,
            auth=self._auth,
            tls=tls,
            resolve=resolve,
            resolve_interval=resolve_interval,
        )
        limit = endpoint.max_inflight_requests
        self._slots = InflightSlots(endpoint, limit) if limit > 0 else None
        #: Where each sequence of late went (`_call_sequence`).
        self._sequences = SequencePlacement(endpoint.name)
        #: Model -> the version its calls that name none are routed by (`pipeline.router.stages.fleet`: the version
        #: the whole fleet serves, while a load is under way or a replica not yet in line serves another).
        self.fleet_versions: Mapping[str, str] = {}

    @property
    def auth(self) -> tuple[tuple[str, str], ...]:
        """The router's own credentials for this stage (its token's metadata)."""
        return self._auth

    async def call(
        self,
        method: str,
        request: object,
        *,
        timeout: float | None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        what: str,
    ):
        """Call an RPC of the stage within `timeout` (retries included); `what` names the step or model in
        errors. `ModelInfer` calls wait for one of the stage's `max_inflight_requests` slots first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        slots = self._slots if method == "ModelInfer" else None
        if slots is not None:
            await slots.acquire(deadline, what)
        try:
            return await self._call(method, request, deadline, (*metadata, *self._auth), what)
        finally:
            if slots is not None:
                slots.release()

    async def _call(
        self,
        method: str,
        request: object,
        deadline: float | None,
        metadata: tuple[tuple[str, str | bytes], ...],
        what: str,
    ):
        replicas = self.replicas
        await replicas.settle()
        tried: set[Replica] = set()
        if method == "ModelInfer":
            # The budget is the stage's inference traffic: the router's own index and metadata calls (one
            # a second) must not buy retries of it.
            self.budget.called()
            if isinstance(request, pb.ModelInferRequest) and SEQUENCE_ID in request.parameters:
                sequence = sequence_of(request)
                if sequence is not None:
                    return await self._call_sequence(request, sequence, deadline, metadata, what)
        model, version = model_of(request)
        version = version or self.fleet_versions.get(model, "")
        replica = replicas.pick(method, tried, model, version)
        if replica is None:
            # Every replica (that may serve the model) is down or draining: answer at once instead of waiting
            # out the deadline.
            raise self._unavailable(what, _none_serving(model))
        attempt = 0
        while True:
            attempt += 1
            started = time.monotonic()
            try:
                reply = await self._send(replica, method, request, self._remaining(deadline, what), metadata)
            except grpc.aio.AioRpcError as err:
                refusal = self._refusal(err, what)
                if refusal is not None:
                    raise refusal from None
                tried.add(replica)
                retry = self._retry(err, replica, tried, attempt, deadline, (method, model, version))
                if retry is None:
                    raise self._unavailable(what, err.details() or "") from None
                log.debug("retrying %s of stage '%s' on %s: %s", what, self.endpoint.name, retry[0], err)
                if retry[1]:
                    await asyncio.sleep(retry[1])
                replica = retry[0]
                continue
            self._answered(replica, method, started)
            return reply

    def _retry(
        self,
        err: grpc.aio.AioRpcError,
        replica: Replica,
        tried: set[Replica],
        attempt: int,
        deadline: float | None,
        call: tuple[str, str, str],
    ) -> tuple[Replica, float] | None:
        """Where and after how long a call that brought nothing back (`err`: UNAVAILABLE or CANCELLED) goes
        again, within the retry attempts, the deadline and the budget; None where it does not. `call`: its
        method, model and version."""
        refused = not_started(err)
        # A connection that ended under the call (recycled, whether a stream or a frame connection carried
        # it) says nothing of the replica: its health watch does. Anything else that brought nothing back:
        # the replica is gone or going; skip it until its health says SERVING.
        cut_off = isinstance(err, ConnectionRecycled)
        if not refused and not cut_off:
            self.replicas.set_state(replica, DOWN)
        following = self.replicas.pick(*call[:1], tried, *call[1:])
        delay = 0.0
        if following is None and cut_off and attempt == 1:
            following = replica  # at once, on a new connection
        elif following is None and not refused:
            # A lone replica that dropped the call may be back after a pause (a restart).
            following, delay = replica, self.retry.backoff(attempt)
        if (
            following is None
            or attempt >= self.retry.attempts
            or (deadline is not None and time.monotonic() + delay >= deadline)
            or not self.budget.try_retry()
        ):
            return None
        if self.metrics is not None:
            self.metrics.stage_retries.labels(self.endpoint.name).inc()
        return following, delay

    async def _call_sequence(
        self,
        request: pb.ModelInferRequest,
        sequence: SequenceId,
        deadline: float | None,
        metadata: tuple[tuple[str, str | bytes], ...],
        what: str,
    ) -> pb.ModelInferResponse:
        """A request of a sequence goes where its state is, never elsewhere (`SequencePlacement`). A
        replica that does not know the sequence refuses the request without running it, so the next one up
        is asked: the sequence may have started before a replica that now ranks above it came (a
        scale-up). Where its replica has gone, the sequence is lost: its request is answered UNAVAILABLE
        naming it, while a sequence that starts may go to the next replica."""
        model = request.model_name
        version = request.model_version or self.fleet_versions.get(model, "")
        ranked, up = self._sequences.candidates(self.replicas, sequence, model, version)
        refused: StageError | None = None
        # What the last replica that did not start the request said (a START past its backlog, say).
        declined = ""
        for replica in up:
            started = time.monotonic()
            try:
                reply = await self._send(
                    replica, "ModelInfer", request, self._remaining(deadline, what), metadata
                )
            except grpc.aio.AioRpcError as err:
                refusal = self._refusal(err, what)
                if isinstance(refusal, StageError) and not_known(refusal, sequence):
                    refused = refused or refusal
                    continue
                if refusal is not None:
                    raise refusal from None
                if not_started(err):
                    declined = err.details() or ""
                elif not isinstance(err, ConnectionRecycled):
                    self.replicas.set_state(replica, DOWN)
                if sequence.start and self.budget.try_retry():
                    continue  # nothing of a sequence that starts is lost: the next replica takes it
                why = f"failed ({err.details() or ''})"
                raise self._sequences.lost(sequence, model, replica.address, why) from None
            self._answered(replica, "ModelInfer", started)
            self._sequences.placed(sequence, replica.address)
            return reply
        if refused is not None:
            # No replica that is up knows the sequence: it was on one that is not, else it never started.
            gone = [r for r in ranked if r.state != SERVING]
            if gone:
                raise self._sequences.lost(sequence, model, gone[0].address, "is down")
            raise refused
        raise self._unavailable(what, declined or _none_serving(model))

    def _remaining(self, deadline: float | None, what: str) -> float | None:
        """The seconds left to `deadline` (None: no deadline); `DeadlineExceeded` where none are."""
        if deadline is None:
            return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"deadline exceeded in {what} on stage '{self.endpoint.name}'")
        return remaining

    def _answered(self, replica: Replica, method: str, started: float) -> None:
        """Count a call that came back: the replica's latency (inference only) and the call's outcome."""
        if method == "ModelInfer":
            now = time.monotonic()
            replica.observe(now - started, now)
        if self.metrics is not None:
            self.metrics.stage_calls.labels(self.endpoint.name, "OK").inc()

    def _unavailable(self, what: str, why: str) -> Unavailable:
        return Unavailable(
            f"stage '{self.endpoint.name}' ({self.endpoint.address}) is unavailable for {what}: {why}"
        )

    async def _send(
        self,
        replica: Replica,
        method: str,
        request: object,
        timeout: float | None,
        metadata: tuple[tuple[str, str | bytes], ...],
    ):
        replica.outstanding += 1
        replica.calls += 1
        try:
            if method == "ModelInfer" and isinstance(request, pb.ModelInferRequest):
                return await replica.link.infer(request, timeout, metadata)
            return await getattr(replica.stub, method)(request, timeout=timeout, metadata=metadata)
        finally:
            replica.outstanding -= 1

    async def stream(
        self,
        request: pb.ModelInferRequest,
        *,
        timeout: float | None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        what: str,
    ) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
        """A decoupled model's responses to `request`, in order, up to the one marked final; an error the
        model sends comes as a response of its own. Each such request gets a `ModelStreamInfer` call of its
        own, so that its flow control is its own: a client that reads slowly holds back only its own model's
        responses, all the way to the model, and closing the iterator early cancels the call, which stops the
        model. It waits for one of the stage's `max_inflight_requests` slots first and holds it to the end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._slots is not None:
            await self._slots.acquire(deadline, what)
        try:
            await self.replicas.settle()
            model = request.model_name
            version = request.model_version or self.fleet_versions.get(model, "")
            replica = self.replicas.pick("ModelInfer", set(), model, version)
            if replica is None:
                raise self._unavailable(what, _none_serving(model))
            replica.outstanding += 1
            try:
                # Closed as this generator is: an iterator left early cancels its call, which stops the model.
                async with contextlib.aclosing(replica.link.decoupled(request, timeout, metadata)) as replies:
                    async for reply in replies:
                        yield reply
                        if is_final(reply):
                            return
                raise StageError(
                    f"{what} on stage '{self.endpoint.name}': the stream ended before the final response",
                    grpc.StatusCode.INTERNAL,
                )
            except grpc.aio.AioRpcError as err:
                raise self._refusal(err, what) or self._unavailable(what, err.details() or "") from None
            finally:
                replica.outstanding -= 1
        finally:
            if self._slots is not None:
                self._slots.release()

    def _refusal(self, err: grpc.aio.AioRpcError, what: str) -> Exception | None:
        """The router's error for a failed call, counted by its status: `DeadlineExceeded`, or `StageError`
        with the stage's code and the items it refused; None where no answer came (UNAVAILABLE, CANCELLED),
        which another replica may give. Our own cancellation arrives as `asyncio.CancelledError`: a
        CANCELLED status is the replica's (a server stopping without grace cuts its calls off)."""
        code = err.code()
        name = self.endpoint.name
        if self.metrics is not None:
            self.metrics.stage_calls.labels(name, code.name).inc()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(f"deadline exceeded in {what} on stage '{name}'")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return None
        return StageError(f"{what} on stage '{name}': {err.details() or ''}", code, items=item_errors(err))

    async def replica_index(
        self, replica: Replica, *, ready_only: bool
    ) -> list[pb.RepositoryIndexResponse.ModelIndex] | None:
        """One replica's `RepositoryIndex` (`pipeline.router.stages.stage_models.replica_index`)."""
        return await stage_models.replica_index(self, replica, ready_only=ready_only)

    async def signature(self, model: str) -> ModelSignature:
        """A model's interface (`pipeline.router.stages.stage_models.model_signature`)."""
        return await stage_models.model_signature(self, model)

    def start(self) -> None:
        """Follow the stage's replicas: look its name up again and again, and watch their health."""
        self.replicas.start()

    async def close(self) -> None:
        await self.replicas.close()


class InflightSlots:
    """A stage's `max_inflight_requests`: its calls wait for a slot, within their deadline."""

    def __init__(self, endpoint: StageEndpoint, limit: int) -> None:
        self._endpoint = endpoint
        self._slots = asyncio.Semaphore(limit)

    async def acquire(self, deadline: float | None, what: str) -> None:
        if deadline is None:
            await self._slots.acquire()
            return
        try:
            await asyncio.wait_for(self._slots.acquire(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded(
                f"deadline exceeded waiting for stage '{self._endpoint.name}' "
                f"(max_inflight_requests {self._endpoint.max_inflight_requests}) for {what}"
            ) from None

    def release(self) -> None:
        self._slots.release()


def _none_serving(model: str) -> str:
    """Why no replica was picked for a call: those that may serve its model (or all) are down or draining."""
    return f"no replica that serves model '{model}' is serving" if model else "no replica is serving"

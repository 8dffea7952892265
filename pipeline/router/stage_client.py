"""The router's client of one stage service: its calls, their retries and the mapping of their errors.

A stage is any server that speaks the Open Inference Protocol. Its replicas, their channels and health,
and the choice of one for each call are `pipeline.router.replicas`; which calls are sent again, and how
many, `pipeline.router.retry`. Its failures become the router's errors
(`Unavailable` naming the stage and its address, `DeadlineExceeded`, `StageError` with the stage's code),
and a call that finds a replica gone is retried on another within the request's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import replace

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.ensemble.plan import ModelSignature, StageEndpoint
from pipeline.protocol.codec import specs_from_metadata
from pipeline.protocol.errors import (
    ERROR_DOMAIN,
    NOT_STARTED,
    DeadlineExceeded,
    ItemError,
    StageError,
    Unavailable,
)
from pipeline.protocol.model_config import batching_of_config, is_deterministic, pad_values
from pipeline.protocol.sequences import SEQUENCE_ID, SequenceId, sequence_key, sequence_of
from pipeline.router.replicas import DOWN, SERVING, UNKNOWN, Replica, Replicas
from pipeline.router.retry import RetryBudget, StageRetry
from pipeline.router.targets import Resolve
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.security import ClientTls, bearer_metadata
from pipeline.transport.grpc_stream import StreamBroken

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
    """One stage endpoint: its replicas (`pipeline.router.replicas`: a channel each, load-aware picking),
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
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None
        #: The replica (address) each sequence of late went to, most recent last: a request of a sequence
        #: whose replica has gone is answered at once (`_call_sequence`).
        self._placed: OrderedDict[str, str] = OrderedDict()
        #: Model -> the version its calls that name none are routed by (`pipeline.router.fleet`: the version
        #: the whole fleet serves, while a load is under way or a replica not yet in line serves another).
        self.fleet_versions: Mapping[str, str] = {}

    @property
    def auth(self) -> tuple[tuple[str, str], ...]:
        """The router's own credentials for this stage (its token's metadata)."""
        return self._auth

    # --- replicas ------------------------------------------------------------------------------------

    # --- calls ---------------------------------------------------------------------------------------

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
            await self._acquire(slots, deadline, what)
        try:
            return await self._call(method, request, deadline, (*metadata, *self._auth), what)
        finally:
            if slots is not None:
                slots.release()

    async def _acquire(self, slots: asyncio.Semaphore, deadline: float | None, what: str) -> None:
        if deadline is None:
            await slots.acquire()
            return
        try:
            await asyncio.wait_for(slots.acquire(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded(
                f"deadline exceeded waiting for stage '{self.endpoint.name}' "
                f"(max_inflight_requests {self.endpoint.max_inflight_requests}) for {what}"
            ) from None

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
        name, address = self.endpoint.name, self.endpoint.address
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
            raise Unavailable(f"stage '{name}' ({address}) is unavailable for {what}: {_none_serving(model)}")
        attempt = 0
        while True:
            attempt += 1
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"deadline exceeded in {what} on stage '{name}'")
            started = time.monotonic()
            try:
                reply = await self._send(replica, method, request, remaining, metadata)
            except grpc.aio.AioRpcError as err:
                code, details = err.code(), err.details() or ""
                if self.metrics is not None:
                    self.metrics.stage_calls.labels(name, code.name).inc()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise DeadlineExceeded(f"deadline exceeded in {what} on stage '{name}'") from None
                # NOTE: our own cancellation arrives as asyncio.CancelledError; a CANCELLED status is the
                # replica's (a server stopping without grace cuts its calls off): no answer, as UNAVAILABLE.
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise StageError(
                        f"{what} on stage '{name}': {details}", code, items=item_errors(err)
                    ) from None
                unavailable = Unavailable(f"stage '{name}' ({address}) is unavailable for {what}: {details}")
                refused = not_started(err)
                # A stream that ended under the call (its connection recycled) says nothing of the replica:
                # its health watch does. Anything else that brought nothing back: the replica is gone or
                # going; skip it until its health says SERVING.
                cut_off = isinstance(err, StreamBroken)
                if not refused and not cut_off:
                    replicas.set_state(replica, DOWN)
                tried.add(replica)
                following = replicas.pick(method, tried, model, version)
                delay = 0.0
                if following is None and cut_off and attempt == 1:
                    following = replica  # at once, on a new stream
                elif following is None and not refused:
                    # A lone replica that dropped the call may be back after a pause (a restart).
                    following, delay = replica, self.retry.backoff(attempt)
                if (
                    following is None
                    or attempt >= self.retry.attempts
                    or (deadline is not None and time.monotonic() + delay >= deadline)
                    or not self.budget.try_retry()
                ):
                    raise unavailable from None
                if self.metrics is not None:
                    self.metrics.stage_retries.labels(name).inc()
                log.debug("retrying %s of stage '%s' on %s: %s", what, name, following.address, details)
                if delay:
                    await asyncio.sleep(delay)
                replica = following
                continue
            if method == "ModelInfer":
                now = time.monotonic()
                replica.observe(now - started, now)
            if self.metrics is not None:
                self.metrics.stage_calls.labels(name, "OK").inc()
            return reply

    async def _call_sequence(
        self,
        request: pb.ModelInferRequest,
        sequence: SequenceId,
        deadline: float | None,
        metadata: tuple[tuple[str, str | bytes], ...],
        what: str,
    ) -> pb.ModelInferResponse:
        """A request of a sequence goes where its state is, never elsewhere: the replica this client sent
        the sequence to, else the first that is up in the order its id ranks the replicas
        (`Replicas.rank`), which every router computes alike. A replica that does not know the sequence
        refuses the request without running it, so the next one up is asked: the sequence may have started
        before a replica that now ranks above it came (a scale-up). Where its replica has gone, the sequence
        is lost: its request is answered UNAVAILABLE naming it, while a sequence that starts may go to the
        next replica."""
        replicas, name = self.replicas, self.endpoint.name
        model = request.model_name
        version = request.model_version or self.fleet_versions.get(model, "")
        key = sequence_key(sequence)
        ranked = replicas.rank(key, model, version)
        up = [r for r in ranked if r.state == SERVING] or [r for r in ranked if r.state == UNKNOWN]
        placed = self._placed.get(key)
        if placed is not None and not sequence.start:
            held = [r for r in up if r.address == placed]
            if not held:
                raise Unavailable(_lost(sequence, model, name, placed, "is no longer serving"))
            up = held
        refused: StageError | None = None
        for replica in up:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"deadline exceeded in {what} on stage '{name}'")
            started = time.monotonic()
            try:
                reply = await self._send(replica, "ModelInfer", request, remaining, metadata)
            except grpc.aio.AioRpcError as err:
                code, details = err.code(), err.details() or ""
                if self.metrics is not None:
                    self.metrics.stage_calls.labels(name, code.name).inc()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise DeadlineExceeded(f"deadline exceeded in {what} on stage '{name}'") from None
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    error = StageError(f"{what} on stage '{name}': {details}", code, items=item_errors(err))
                    if _no_start(code, details, sequence):
                        refused = refused or error
                        continue
                    raise error from None
                if not not_started(err) and not isinstance(err, StreamBroken):
                    replicas.set_state(replica, DOWN)
                if sequence.start and self.budget.try_retry():
                    continue  # nothing of a sequence that starts is lost: the next replica takes it
                raise Unavailable(
                    _lost(sequence, model, name, replica.address, f"failed ({details})")
                ) from None
            now = time.monotonic()
            replica.observe(now - started, now)
            if self.metrics is not None:
                self.metrics.stage_calls.labels(name, "OK").inc()
            self._placed.pop(key, None)
            if not sequence.end:
                self._placed[key] = replica.address
                if len(self._placed) > _PLACED_LIMIT:
                    self._placed.popitem(last=False)
            return reply
        if refused is not None:
            # No replica that is up knows the sequence: it was on one that is not, else it never started.
            gone = [r for r in ranked if r.state != SERVING]
            if gone:
                raise Unavailable(_lost(sequence, model, name, gone[0].address, "is down"))
            raise refused
        raise Unavailable(
            f"stage '{name}' ({self.endpoint.address}) is unavailable for {what}: {_none_serving(model)}"
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
            await self._acquire(self._slots, deadline, what)
        try:
            await self.replicas.settle()
            model = request.model_name
            version = request.model_version or self.fleet_versions.get(model, "")
            replica = self.replicas.pick("ModelInfer", set(), model, version)
            name, address = self.endpoint.name, self.endpoint.address
            if replica is None:
                raise Unavailable(
                    f"stage '{name}' ({address}) is unavailable for {what}: "
                    f"{_none_serving(request.model_name)}"
                )
            replica.outstanding += 1
            try:
                # Closed as this generator is: an iterator left early cancels its call, which stops the model.
                async with contextlib.aclosing(replica.link.decoupled(request, timeout, metadata)) as replies:
                    async for reply in replies:
                        yield reply
            except grpc.aio.AioRpcError as err:
                raise self._stream_error(err, what) from None
            finally:
                replica.outstanding -= 1
        finally:
            if self._slots is not None:
                self._slots.release()

    def _stream_error(self, err: grpc.aio.AioRpcError, what: str) -> Exception:
        """The router's error for a failed streamed call, as `_call` maps a unary one's."""
        code, details = err.code(), err.details() or ""
        name, address = self.endpoint.name, self.endpoint.address
        if self.metrics is not None:
            self.metrics.stage_calls.labels(name, code.name).inc()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(f"deadline exceeded in {what} on stage '{name}'")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return Unavailable(f"stage '{name}' ({address}) is unavailable for {what}: {details}")
        return StageError(f"{what} on stage '{name}': {details}", code, items=item_errors(err))

    async def replica_index(
        self, replica: Replica, *, ready_only: bool
    ) -> list[pb.RepositoryIndexResponse.ModelIndex] | None:
        """One replica's `RepositoryIndex` (None where its server has none); `Unavailable` where it cannot
        answer now, `StageError` for another failure. Replicas of a stage may serve different models, so each
        is asked for its own."""
        name = self.endpoint.name
        try:
            reply = await replica.stub.RepositoryIndex(
                pb.RepositoryIndexRequest(ready=ready_only), timeout=2.0, metadata=self._auth
            )
        except grpc.aio.AioRpcError as err:
            code, details = err.code(), err.details() or ""
            if self.metrics is not None:
                self.metrics.stage_calls.labels(name, code.name).inc()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return None
            where = f"stage '{name}' ({replica.address})"
            if code in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.CANCELLED,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                raise Unavailable(f"{where} is unavailable for its repository index: {details}") from None
            raise StageError(f"the repository index of {where}: {details}", code) from None
        if self.metrics is not None:
            self.metrics.stage_calls.labels(name, "OK").inc()
        return list(reply.models)

    async def signature(self, model: str) -> ModelSignature:
        """A model's interface, from its `ModelMetadata` and (where the stage has it) Triton's `ModelConfig`."""
        what = f"model '{model}'"
        meta = await self.call("ModelMetadata", pb.ModelMetadataRequest(name=model), timeout=2.0, what=what)
        inputs, outputs = specs_from_metadata(meta.inputs), specs_from_metadata(meta.outputs)
        cache, deterministic, decoupled, sequence = False, True, False, False
        try:
            reply = await self.call("ModelConfig", pb.ModelConfigRequest(name=model), timeout=2.0, what=what)
            cache, deterministic = reply.config.response_cache.enable, is_deterministic(reply.config)
            decoupled = reply.config.model_transaction_policy.decoupled
            sequence = reply.config.HasField("sequence_batching")
            max_batch_size = reply.config.max_batch_size
            padding = pad_values(reply.config)
            inputs = tuple(replace(s, pad_value=padding.get(s.name)) for s in inputs)
            outputs = tuple(replace(s, pad_value=padding.get(s.name)) for s in outputs)
            try:
                batching = batching_of_config(reply.config)
            except ValueError as exc:
                log.warning(
                    "model '%s' on stage '%s': ignoring its dynamic_batching: %s",
                    model,
                    self.endpoint.name,
                    exc,
                )
                batching = None
        except StageError as err:
            if err.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            # A plain OIP server without Triton's ModelConfig: a leading -1 everywhere means it batches.
            batches = all(spec.shape[:1] == (-1,) for spec in (*inputs, *outputs))
            max_batch_size = sys.maxsize if batches else 0
            batching = None
        return ModelSignature(
            model,
            inputs,
            outputs,
            max_batch_size,
            batching,
            tuple(meta.versions),
            cache,
            deterministic,
            decoupled,
            sequence,
        )

    def start(self) -> None:
        """Follow the stage's replicas: look its name up again and again, and watch their health."""
        self.replicas.start()

    async def close(self) -> None:
        await self.replicas.close()


#: Sequences whose replica a client remembers (the oldest forgotten first).
_PLACED_LIMIT = 65536


def _lost(sequence: SequenceId, model: str, stage: str, address: str, why: str) -> str:
    return (
        f"sequence {sequence.value} of model '{model}' is lost: its state was on replica {address} of stage "
        f"'{stage}', which {why}; start the sequence again (sequence_start)"
    )


def _no_start(code: grpc.StatusCode, details: str, sequence: SequenceId) -> bool:
    """Whether a stage refused a request of a sequence as one it does not know (Triton's message)."""
    return (
        code == grpc.StatusCode.INVALID_ARGUMENT
        and not sequence.start
        and "must specify the START flag on the first request of the sequence" in details
    )


def _none_serving(model: str) -> str:
    """Why no replica was picked for a call: those that may serve its model (or all) are down or draining."""
    return f"no replica that serves model '{model}' is serving" if model else "no replica is serving"

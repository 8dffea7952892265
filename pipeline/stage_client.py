"""The router's client of one stage service: its channel, load balancing, retries and error mapping.

A stage is any server that speaks the Open Inference Protocol. Its failures become the router's errors
(`Unavailable` naming the stage and its address, `DeadlineExceeded`, `StageError` with the stage's code),
and a call that finds a replica gone is retried on another within the request's deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from pipeline.convert import batching_of_config, pad_values, specs_from_metadata
from pipeline.errors import DeadlineExceeded, StageError, Unavailable
from pipeline.metrics import Metrics
from pipeline.plan import ModelSignature, StageEndpoint
from pipeline.security import bearer_metadata
from pipeline.server import server_options

log = logging.getLogger(__name__)


#: How the router reaches a stage's replicas. A target that resolves to several addresses (a `dns:///`
#: name of a scaled service, or `ipv4:a:p,b:p`) is spread round robin; a call that finds a replica gone
#: (UNAVAILABLE: nothing was processed) is retried on another, within the request's deadline. Stage calls
#: are idempotent, so a retry is safe. gRPC's client-side health checking watches each replica's health
#: service: a replica that says NOT_SERVING (loading, or draining after SIGTERM) gets no new calls until it
#: says SERVING again; a server without the Watch RPC counts as healthy.
STAGE_SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    # Round robin skips a replica whose health service says NOT_SERVING (one that is draining).
    "healthCheckConfig": {"serviceName": ""},
    "methodConfig": [
        {
            "name": [{"service": "inference.GRPCInferenceService"}],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
}
STAGE_CHANNEL_OPTIONS = [
    ("grpc.service_config", json.dumps(STAGE_SERVICE_CONFIG)),
    ("grpc.enable_retries", 1),
    # Look the name up again soon after a replica goes away or a connection is recycled.
    ("grpc.dns_min_time_between_resolutions_ms", 1000),
]


@dataclass(frozen=True, slots=True)
class StageRetry:
    """The router's own retries of a stage call that failed UNAVAILABLE, on top of gRPC's retry policy.

    gRPC retries transparently only calls that never reached a server, or whose request still fits its
    retry buffer (256 KiB) and whose server never answered; a call in flight to a replica that dies with a
    larger request (a batch of images) fails UNAVAILABLE ("Socket closed"). Stage calls are idempotent, so
    the router calls again, on whichever replica the balancer picks, with backoff, within the deadline.
    """

    #: Calls in all, the first included.
    attempts: int = 4
    initial_backoff: float = 0.05
    max_backoff: float = 0.5
    multiplier: float = 2.0

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1, 2, ...): exponential, with jitter so that the
        calls that failed together do not return together."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        return random.uniform(ceiling / 2, ceiling)


def _tls_name(address: str) -> str | None:
    """The name a stage's certificate must carry when the target itself names none: an `ipv4:a,b` list's
    authority is the whole list, so its first host stands for every replica."""
    if not address.startswith(("ipv4:", "ipv6:")):
        return None
    first = address.split(":", 1)[1].split(",", 1)[0]
    host = first.rsplit(":", 1)[0] if first.count(":") == 1 or first.startswith("[") else first
    return host.strip("[]")


class StageClient:
    """One stage endpoint: a channel, its stubs, and the mapping of its failures to router errors."""

    def __init__(
        self,
        endpoint: StageEndpoint,
        *,
        max_message_bytes: int,
        metrics: Metrics | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        retry: StageRetry | None = None,
        token: str | None = None,
    ) -> None:
        """`token`: the router's own bearer token for stages that ask for one (sent with every call)."""
        self.endpoint = endpoint
        self.metrics = metrics
        self.retry = retry or StageRetry()
        options = [*server_options(max_message_bytes), *STAGE_CHANNEL_OPTIONS]
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(endpoint.address, options=options)
        else:
            override = _tls_name(endpoint.address)
            if override is not None:
                options.append(("grpc.ssl_target_name_override", override))
            self.channel = grpc.aio.secure_channel(endpoint.address, credentials, options=options)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False
        #: The models the router's steps call here: where the stage has no health service, their
        #: `ModelReady` says whether it serves.
        self.models: set[str] = set()
        self._auth = bearer_metadata(token)
        limit = endpoint.max_inflight_requests
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None

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
        name, address = self.endpoint.name, self.endpoint.address
        attempt = 0
        while True:
            attempt += 1
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"deadline exceeded in {what} on stage '{name}'")
            try:
                reply = await getattr(self.stub, method)(request, timeout=remaining, metadata=metadata)
            except grpc.aio.AioRpcError as err:
                code, details = err.code(), err.details() or ""
                if self.metrics is not None:
                    self.metrics.stage_calls.labels(name, code.name).inc()
                if code == grpc.StatusCode.UNAVAILABLE:
                    delay = self.retry.backoff(attempt)
                    if (
                        attempt < self.retry.attempts
                        and (deadline is None or time.monotonic() + delay < deadline)
                        and self._may_answer()
                    ):
                        log.debug("retrying %s on stage '%s' in %.3fs: %s", what, name, delay, details)
                        await asyncio.sleep(delay)
                        continue
                    self.healthy = False
                    raise Unavailable(
                        f"stage '{name}' ({address}) is unavailable for {what}: {details}"
                    ) from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise DeadlineExceeded(f"deadline exceeded in {what} on stage '{name}'") from None
                raise StageError(f"{what} on stage '{name}': {details}", code) from None
            if self.metrics is not None:
                self.metrics.stage_calls.labels(name, "OK").inc()
            return reply

    def _may_answer(self) -> bool:
        """Whether a retry can reach a replica: not when every replica is down (the channel is in
        TRANSIENT_FAILURE), so that a stage that is down fails its requests fast."""
        state = self.channel.get_state(try_to_connect=False)
        return state != grpc.ChannelConnectivity.TRANSIENT_FAILURE

    async def signature(self, model: str) -> ModelSignature:
        """A model's interface, from its `ModelMetadata` and (where the stage has it) Triton's `ModelConfig`."""
        what = f"model '{model}'"
        meta = await self.call("ModelMetadata", pb.ModelMetadataRequest(name=model), timeout=2.0, what=what)
        inputs, outputs = specs_from_metadata(meta.inputs), specs_from_metadata(meta.outputs)
        try:
            reply = await self.call("ModelConfig", pb.ModelConfigRequest(name=model), timeout=2.0, what=what)
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
        return ModelSignature(model, inputs, outputs, max_batch_size, batching)

    async def check_health(self, timeout: float) -> bool:
        """Ask the stage's health service; remember and return whether it is SERVING. A stage without one
        (the protocol does not require it) serves when its `ServerReady` and the `ModelReady` of each of
        `models` say so."""
        try:
            # The stubs (types-grpcio-health-checking) declare HealthStub without its methods.
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)  # type: ignore[attr-defined]
            self.healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as err:
            self.healthy = err.code() == grpc.StatusCode.UNIMPLEMENTED and await self._protocol_ready(timeout)
        return self.healthy

    async def _protocol_ready(self, timeout: float) -> bool:
        try:
            server = await self.stub.ServerReady(
                pb.ServerReadyRequest(), timeout=timeout, metadata=self._auth
            )
            if not server.ready:
                return False
            for model in sorted(self.models):
                reply = await self.stub.ModelReady(
                    pb.ModelReadyRequest(name=model), timeout=timeout, metadata=self._auth
                )
                if not reply.ready:
                    return False
        except grpc.aio.AioRpcError:
            return False
        return True

    async def close(self) -> None:
        await self.channel.close()

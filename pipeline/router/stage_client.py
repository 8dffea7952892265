"""The router's client of one stage service: its channel, load balancing, retries and error mapping.

A stage is any server that speaks the Open Inference Protocol. Its failures become the router's errors
(`Unavailable` naming the stage and its address, `DeadlineExceeded`, `StageError` with the stage's code),
and a call that finds a replica gone is retried on another within the request's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
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
from pipeline.runtime.metrics import Metrics
from pipeline.runtime.security import bearer_metadata
from pipeline.runtime.server import server_options

log = logging.getLogger(__name__)


#: Seconds between look-ups of a stage's DNS name (env `PIPELINE_RESOLVE_INTERVAL_S`): a replica that starts
#: gets calls within about this long, and one that is gone from DNS stops getting them as promptly.
RESOLVE_INTERVAL_S = float(os.environ.get("PIPELINE_RESOLVE_INTERVAL_S", "5"))

#: How a stage target's addresses are found: `(host, port) -> ["ip:port", ...]`. Tests inject their own.
Resolve = Callable[[str, int], Awaitable[list[str]]]


async def resolve_dns(host: str, port: int) -> list[str]:
    """The addresses of `host` (asyncio's getaddrinfo): its IPv4 addresses, or its IPv6 ones if it has none
    (`localhost` resolving to both would otherwise count one server as two replicas)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = [info[4][0] for info in infos if info[0] == socket.AF_INET]
    v6 = [info[4][0] for info in infos if info[0] == socket.AF_INET6]
    if v4:
        return [f"{ip}:{port}" for ip in dict.fromkeys(v4)]
    return [f"[{ip}]:{port}" for ip in dict.fromkeys(v6)]


@dataclass(frozen=True, slots=True)
class Target:
    """A stage address taken apart: fixed replica addresses, or a DNS name to look up again and again."""

    #: `ipv4:`/`ipv6:` lists and `unix:` paths: the replicas, once and for all.
    fixed: tuple[str, ...] = ()
    host: str = ""
    port: int = 0

    @classmethod
    def parse(cls, address: str) -> Target:
        """Read gRPC's target syntax: `ipv4:a:p,b:p`, `ipv6:[a]:p,...`, `dns:///host:port` (or
        `dns://authority/host:port`), `unix:path`, or a plain `host:port` (looked up by name)."""
        scheme, sep, rest = address.partition(":")
        if sep and scheme in ("ipv4", "ipv6"):
            return cls(fixed=tuple(f"{scheme}:{a.strip()}" for a in rest.split(",") if a.strip()))
        if sep and scheme in ("unix", "unix-abstract"):
            return cls(fixed=(address,))
        name = address
        if sep and scheme == "dns":
            name = rest[2:].partition("/")[2] if rest.startswith("//") else rest
        host, port = _host_port(name)
        return cls(host=host, port=port)


def _host_port(name: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port`; gRPC's default port (443) when none is given."""
    if name.startswith("["):
        host, _, tail = name[1:].partition("]")
        return host, int(tail[1:]) if tail.startswith(":") else 443
    host, sep, port = name.rpartition(":")
    if not sep:
        return name, 443
    return host, int(port)


@dataclass(frozen=True, slots=True)
class StageRetry:
    """The one retry layer of stage calls (gRPC's own retry policy is off).

    Only a call the stage did not start is sent again: a transport failure before any answer (the replica
    is gone, or died with the call in flight), or an UNAVAILABLE whose details say NOT_STARTED (a model not
    loaded yet, a full queue, a draining server). A refusal goes to another replica at once, never back to
    the one that refused; a transport failure goes to another replica when there is one, else to the same
    after a jittered backoff. Stage calls are idempotent, which makes a repeat safe. Every retry is also
    paid from the stage's `RetryBudget`.
    """

    #: Calls in all, the first included.
    attempts: int = 3
    initial_backoff: float = 0.05
    max_backoff: float = 0.5
    multiplier: float = 2.0

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1, 2, ...): exponential, with jitter so that the
        calls that failed together do not return together."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        return random.uniform(ceiling / 2, ceiling)


class RetryBudget:
    """Retries of one stage bounded by its traffic, as Finagle's `RetryBudget` and Envoy's retry budgets do.

    Over the last `window` seconds, retries may be at most `ratio` of the calls made, plus `floor`. With
    the defaults (20%, 10 per 10 s): an overloaded stage that refuses everything sees at most 1.2 times
    the calls it would see without retries (plus one a second), so retries cannot turn overload into a
    storm; while a stage with little traffic still rides out a replica that dies with a few batches in
    flight (each replica holds `max_inflight_batches`, usually 1 or 2, so 10 covers several replicas
    failing at once).
    """

    def __init__(
        self,
        ratio: float = 0.2,
        floor: int = 10,
        window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ratio, self.floor, self.window, self._clock = ratio, floor, window, clock
        #: (second, calls, retries) per second of the window, oldest first.
        self._seconds: deque[list[int]] = deque()
        self.calls = self.retries = self.refused = 0  # totals, for metrics and tests

    def _current(self) -> list[int]:
        now = int(self._clock())
        seconds = self._seconds
        while seconds and seconds[0][0] <= now - self.window:
            seconds.popleft()
        if not seconds or seconds[-1][0] != now:
            seconds.append([now, 0, 0])
        return seconds[-1]

    def called(self) -> None:
        """A first attempt was made (a retry is not counted here)."""
        self._current()[1] += 1
        self.calls += 1

    def try_retry(self) -> bool:
        """Take one retry from the budget; False (and nothing taken) when it is spent."""
        current = self._current()
        calls = sum(s[1] for s in self._seconds)
        retries = sum(s[2] for s in self._seconds)
        if retries + 1 > self.ratio * calls + self.floor:
            self.refused += 1
            return False
        current[2] += 1
        self.retries += 1
        return True


#: A replica's health as the router knows it: not heard yet, SERVING, NOT_SERVING (loading or
#: draining: it answers metadata but takes no inference), or DOWN (unreachable).
UNKNOWN, SERVING, NOT_SERVING, DOWN = "unknown", "serving", "not_serving", "down"


class Replica:
    """One address of a stage: its own channel and health watch, and what its calls tell about its load."""

    #: Weight of the newest latency sample in the moving average.
    ALPHA = 0.3
    #: A latency learnt this long ago counts half: a replica that was slow gets calls again to show it.
    HALF_LIFE_S = 5.0

    def __init__(self, address: str, channel: grpc.aio.Channel) -> None:
        self.address = address
        self.channel = channel
        self.stub = pb_grpc.GRPCInferenceServiceStub(channel)
        self.health_stub = health_pb2_grpc.HealthStub(channel)
        self.state = UNKNOWN
        self.heard = asyncio.Event()
        self.outstanding = 0
        self.calls = 0
        #: Moving average of its ModelInfer times (seconds), and when it was last updated.
        self.latency = 0.0
        self.sampled = 0.0
        self.watch: asyncio.Task[None] | None = None

    def cost(self, now: float) -> float:
        """The expected wait of one more call (peak-EWMA): latency times the calls already out."""
        decay = 0.5 ** ((now - self.sampled) / self.HALF_LIFE_S) if self.sampled else 1.0
        return self.latency * decay * (self.outstanding + 1)

    def observe(self, seconds: float, now: float) -> None:
        self.latency = seconds if not self.sampled else self.latency + self.ALPHA * (seconds - self.latency)
        self.sampled = now


def _refused(err: grpc.aio.AioRpcError) -> bool:
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


def _tls_name(address: str) -> str | None:
    """The name a stage's certificate must carry: the host of its target (for an `ipv4:a,b` list, the
    first host stands for every replica), since each replica's own channel dials an IP address."""
    target = Target.parse(address)
    if target.fixed:
        first = target.fixed[0].partition(":")[2]
        if address.startswith("unix"):
            return None
        return _host_port(first)[0] if ":" in first else first
    return target.host


class StageClient:
    """One stage endpoint: a channel per replica, load-aware picking, one bounded retry layer, and the
    mapping of its failures to router errors.

    The target's addresses are looked up by the client itself (fixed lists once, DNS names every
    `resolve_interval` seconds), so each replica has its own channel, health watch and count of calls in
    flight. Each call goes to the healthy replica whose calls are expected to finish soonest: its moving
    average latency times its calls in flight plus one (peak EWMA), so a slow or busy replica gets fewer.
    `listeners` hear of every change of the set of ready replicas (a batcher sizes its in-flight batches by
    it).
    """

    def __init__(
        self,
        endpoint: StageEndpoint,
        *,
        max_message_bytes: int,
        metrics: Metrics | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        retry: StageRetry | None = None,
        budget: RetryBudget | None = None,
        resolve: Resolve | None = None,
        resolve_interval: float | None = None,
        token: str | None = None,
    ) -> None:
        """`token`: the router's own bearer token for stages that ask for one (sent with every call)."""
        self.endpoint = endpoint
        self.metrics = metrics
        self.retry = retry or StageRetry()
        self.budget = budget or RetryBudget()
        self.target = Target.parse(endpoint.address)
        self._resolve = resolve or resolve_dns
        self.resolve_interval = RESOLVE_INTERVAL_S if resolve_interval is None else resolve_interval
        self._credentials = credentials
        self._options: list[tuple[str, str | int]] = [
            *server_options(max_message_bytes),
            # One layer of retries, ours: gRPC's would multiply with it.
            ("grpc.enable_retries", 0),
            # Its own connection per replica, even where another client dials the same address.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if credentials is not None and (name := _tls_name(endpoint.address)) is not None:
            self._options.append(("grpc.ssl_target_name_override", name))
        self.replicas: dict[str, Replica] = {}
        self._watching = False
        self.listeners: list[Callable[[], None]] = []
        self.healthy = False
        self._ready_count = 0
        self._resolved = asyncio.Event() if not self.target.fixed else None
        self._resolver: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        if self.target.fixed:
            for address in self.target.fixed:
                self._add(address)
        #: The models the router's steps call here: where the stage has no health service, their
        #: `ModelReady` says whether it serves.
        self.models: set[str] = set()
        self._auth = bearer_metadata(token)
        limit = endpoint.max_inflight_requests
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None

    # --- replicas ------------------------------------------------------------------------------------

    def _add(self, address: str) -> None:
        target = (
            address
            if self.target.fixed
            else (f"ipv6:{address}" if address.startswith("[") else f"ipv4:{address}")
        )
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(target, options=self._options)
        else:
            channel = grpc.aio.secure_channel(target, self._credentials, options=self._options)
        replica = Replica(address, channel)
        known = [r.latency for r in self.replicas.values() if r.sampled]
        if known:  # a newcomer is assumed as fast as the fastest, so it gets calls at once, not all of them
            replica.latency, replica.sampled = min(known), time.monotonic()
        self.replicas[address] = replica
        self._watch_all()

    def _watch_all(self) -> None:
        """Start the health watch of every replica that has none (once an event loop runs)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # made outside the loop: `start()` or the first call starts the watches
        self._watching = True
        for replica in self.replicas.values():
            if replica.watch is None:
                replica.watch = loop.create_task(self._watch(replica))

    def _remove(self, address: str) -> None:
        replica = self.replicas.pop(address)
        if replica.watch is not None:
            replica.watch.cancel()
        # Calls in flight finish on the old channel; new ones no longer pick it.
        task = asyncio.get_running_loop().create_task(replica.channel.close(grace=60.0))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        self._changed()

    async def refresh(self) -> None:
        """Look the stage's DNS name up now and follow the answer: new addresses get a channel, addresses no
        longer listed are dropped (their calls in flight finish). A failed look-up keeps the replicas known."""
        if self.target.fixed:
            return
        try:
            addresses = await self._resolve(self.target.host, self.target.port)
        except OSError as err:
            log.info("stage '%s': cannot look up %s: %s", self.endpoint.name, self.target.host, err)
            addresses = None
        if addresses is not None:
            for address in addresses:
                if address not in self.replicas:
                    log.info("stage '%s': replica %s found", self.endpoint.name, address)
                    self._add(address)
            for address in [a for a in self.replicas if a not in addresses]:
                log.info("stage '%s': replica %s gone", self.endpoint.name, address)
                self._remove(address)
        assert self._resolved is not None
        self._resolved.set()

    def start(self) -> None:
        """Look the name up again every `resolve_interval` seconds (a fixed target needs no look-up)."""
        self._watch_all()
        if self._resolver is None and not self.target.fixed:
            self._resolver = asyncio.get_running_loop().create_task(self._resolve_loop())

    async def _resolve_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.resolve_interval)

    async def _ready(self) -> None:
        if self._resolved is not None and not self._resolved.is_set():
            await self.refresh()
        if not self._watching:
            self._watch_all()

    async def _watch(self, replica: Replica) -> None:
        """Follow a replica's `grpc.health.v1` Watch: NOT_SERVING (loading, draining) takes it out of
        inference at once, SERVING puts it back; a broken stream marks it DOWN and is opened again. A
        server without the Watch RPC counts as serving."""
        failures = 0
        request = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                # The stubs (types-grpcio-health-checking) declare HealthStub without its methods.
                async for reply in replica.health_stub.Watch(request):  # type: ignore[attr-defined]
                    failures = 0
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    self._set_state(replica, SERVING if serving else NOT_SERVING)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    await self._poll_protocol(replica)
                    return
                # NOTE: a stream that was healthy and ended is most often a connection the server recycled
                # (max_connection_age): watch again at once before calling the replica down, or a lone
                # replica would refuse calls for the length of a backoff every time it happens.
                if failures > 0 or replica.state != SERVING:
                    self._set_state(replica, DOWN)
            failures += 1
            if failures > 1:
                await asyncio.sleep(self.retry.backoff(min(failures - 1, 4)))

    async def _poll_protocol(self, replica: Replica, interval: float = 1.0) -> None:
        """A replica without a health service (the protocol does not require one): it serves while its
        `ServerReady` and the `ModelReady` of each of `models` say so, asked every `interval` seconds."""
        while True:
            self._set_state(
                replica, SERVING if await self._protocol_ready(replica, interval) else NOT_SERVING
            )
            await asyncio.sleep(interval)

    async def _protocol_ready(self, replica: Replica, timeout: float) -> bool:
        try:
            server = await replica.stub.ServerReady(
                pb.ServerReadyRequest(), timeout=timeout, metadata=self._auth
            )
            if not server.ready:
                return False
            for model in sorted(self.models):
                reply = await replica.stub.ModelReady(
                    pb.ModelReadyRequest(name=model), timeout=timeout, metadata=self._auth
                )
                if not reply.ready:
                    return False
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self._set_state(replica, DOWN)
            return False
        return True

    def _set_state(self, replica: Replica, state: str) -> None:
        replica.heard.set()
        if replica.state != state:
            replica.state = state
            self._changed()

    def _changed(self) -> None:
        ready = sum(1 for r in self.replicas.values() if r.state == SERVING)
        self.healthy = ready > 0
        if ready != self._ready_count:
            self._ready_count = ready
            for listener in self.listeners:
                listener()

    @property
    def ready_replicas(self) -> int:
        """Replicas whose health says SERVING now."""
        return self._ready_count

    def _pick(self, method: str, tried: set[Replica]) -> Replica | None:
        """The replica for the next call: among those not tried, SERVING ones (for inference), else those not
        heard from yet; for other RPCs, any that is up. The lowest expected wait wins, ties at random."""
        infer = method == "ModelInfer"
        ranks = (SERVING, UNKNOWN) if infer else (SERVING, NOT_SERVING, UNKNOWN)
        now = time.monotonic()
        for rank in ranks:
            candidates = [r for r in self.replicas.values() if r.state == rank and r not in tried]
            if candidates:
                return min(candidates, key=lambda r: (r.cost(now), r.outstanding, random.random()))
        if not infer:  # metadata may still find a replica the health watch has not reached yet
            candidates = [r for r in self.replicas.values() if r not in tried]
            return random.choice(candidates) if candidates else None
        return None

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
        await self._ready()
        name, address = self.endpoint.name, self.endpoint.address
        tried: set[Replica] = set()
        self.budget.called()
        replica = self._pick(method, tried)
        if replica is None:
            # Every replica is down or draining: answer at once instead of waiting out the deadline.
            raise Unavailable(f"stage '{name}' ({address}) is unavailable for {what}: no replica is serving")
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
                refused = _refused(err)
                if not refused:
                    # Nothing came back: the replica is gone or going. Skip it until its health says SERVING.
                    self._set_state(replica, DOWN)
                tried.add(replica)
                following = self._pick(method, tried)
                delay = 0.0
                if following is None and not refused:
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

    @staticmethod
    async def _send(
        replica: Replica,
        method: str,
        request: object,
        timeout: float | None,
        metadata: tuple[tuple[str, str | bytes], ...],
    ):
        replica.outstanding += 1
        replica.calls += 1
        try:
            return await getattr(replica.stub, method)(request, timeout=timeout, metadata=metadata)
        finally:
            replica.outstanding -= 1

    async def signature(self, model: str) -> ModelSignature:
        """A model's interface, from its `ModelMetadata` and (where the stage has it) Triton's `ModelConfig`."""
        what = f"model '{model}'"
        meta = await self.call("ModelMetadata", pb.ModelMetadataRequest(name=model), timeout=2.0, what=what)
        inputs, outputs = specs_from_metadata(meta.inputs), specs_from_metadata(meta.outputs)
        cache, deterministic = False, True
        try:
            reply = await self.call("ModelConfig", pb.ModelConfigRequest(name=model), timeout=2.0, what=what)
            cache, deterministic = reply.config.response_cache.enable, is_deterministic(reply.config)
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
            model, inputs, outputs, max_batch_size, batching, tuple(meta.versions), cache, deterministic
        )

    async def check_health(self, timeout: float) -> bool:
        """Whether any replica is SERVING, waiting up to `timeout` for replicas not heard from yet."""
        await self._ready()
        waiting = [r.heard.wait() for r in self.replicas.values() if not r.heard.is_set()]
        if waiting:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waiting), timeout)
        return self.healthy

    async def close(self) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
        for replica in self.replicas.values():
            if replica.watch is not None:
                replica.watch.cancel()
        await asyncio.gather(
            *(r.channel.close() for r in self.replicas.values()), *self._closing, return_exceptions=True
        )

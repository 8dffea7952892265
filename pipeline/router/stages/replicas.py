"""The replicas of one stage: a channel and a health watch each, and the choice of a replica for a call.

A stage target's addresses are looked up here (fixed lists once, DNS names every `resolve_interval`
seconds), so each replica has its own channel, health watch and count of calls in flight; replicas that
DNS adds or drops come and go. Each call goes to the healthy replica whose calls are expected to finish
soonest: its moving average latency times its calls in flight plus one (peak EWMA), so a slow or busy
replica gets fewer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.router.stages.retry import StageRetry
from pipeline.router.stages.targets import Resolve, Target, read_addresses, resolve_dns, tls_name
from pipeline.runtime.security import ClientTls
from pipeline.runtime.server import keepalive_options, server_options
from pipeline.runtime.settings_values import DEFAULT_RESOLVE_INTERVAL_S
from pipeline.transport import ServerLink

log = logging.getLogger(__name__)


#: A replica's health as the router knows it: not heard yet, SERVING, NOT_SERVING (loading or
#: draining: it answers metadata but takes no inference), or DOWN (unreachable).
UNKNOWN, SERVING, NOT_SERVING, DOWN = "unknown", "serving", "not_serving", "down"


class Replica:
    """One address of a stage: its own channel and health watch, the transport of its calls
    (`pipeline.transport.server_link`), and what its calls tell about its load."""

    #: Weight of the newest latency sample in the moving average.
    ALPHA = 0.3
    #: A latency learnt this long ago counts half: a replica that was slow gets calls again to show it.
    HALF_LIFE_S = 5.0

    def __init__(self, address: str, channel: grpc.aio.Channel, link: ServerLink) -> None:
        self.address = address
        self.channel = channel
        #: How its calls travel: frames, a shared stream or unary calls, chosen by what its server offers.
        self.link = link
        self.stub = link.stub
        self.health_stub = health_pb2_grpc.HealthStub(channel)
        self.state = UNKNOWN
        self.heard = asyncio.Event()
        self.outstanding = 0
        self.calls = 0
        #: Moving average of its ModelInfer times (seconds), and when it was last updated.
        self.latency = 0.0
        self.sampled = 0.0
        self.watch: asyncio.Task[None] | None = None
        #: The models its `RepositoryIndex` listed as READY at the last look, with their READY versions; None
        #: where it cannot say (not asked yet, or its server has no `RepositoryIndex`).
        self.index: Mapping[str, frozenset[str]] | None = None

    def serves(self, model: str, version: str = "") -> bool | None:
        """Whether its `RepositoryIndex` lists `model` (at `version`, where one is asked for) as READY; None
        where it cannot say."""
        if self.index is None:
            return None
        versions = self.index.get(model)
        return versions is not None and (not version or version in versions)

    def cost(self, now: float) -> float:
        """The expected wait of one more call (peak-EWMA): latency times the calls already out."""
        decay = 0.5 ** ((now - self.sampled) / self.HALF_LIFE_S) if self.sampled else 1.0
        return self.latency * decay * (self.outstanding + 1)

    def observe(self, seconds: float, now: float) -> None:
        self.latency = seconds if not self.sampled else self.latency + self.ALPHA * (seconds - self.latency)
        self.sampled = now


def rendezvous(addresses: Iterable[str], key: str) -> list[str]:
    """`addresses` in the order of rendezvous (highest random weight) hashing for `key`: each address weighs
    a hash of itself and the key, the same in every process (unlike `hash`, which is salted), so every router
    ranks alike, and an address that comes or goes moves only the keys it ranks first for."""
    return sorted(addresses, key=lambda address: _weight(address, key), reverse=True)


def _weight(address: str, key: str) -> int:
    digest = hashlib.blake2b(f"{address}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Replicas:
    """The replicas of one stage target, and whether the stage is healthy: any replica SERVING.

    `listeners` hear of every change of the number of ready replicas (a batcher sizes its in-flight batches
    by it).
    """

    def __init__(
        self,
        stage: str,
        address: str,
        *,
        max_message_bytes: int,
        retry: StageRetry,
        auth: Sequence[tuple[str, str]] = (),
        tls: ClientTls | None = None,
        resolve: Resolve | None = None,
        resolve_interval: float | None = None,
    ) -> None:
        """`stage` names the stage in logs; `retry` paces the health watches' reconnections; `auth`: the
        metadata of the protocol's readiness calls (for a stage without a health service); `tls`: the TLS of
        the replicas' channels and frame connections, which verify the name `tls_name` gives."""
        self.stage = stage
        self.retry = retry
        self.target = Target.parse(address)
        self._resolve = resolve or (read_addresses if self.target.file else resolve_dns)
        self.resolve_interval = DEFAULT_RESOLVE_INTERVAL_S if resolve_interval is None else resolve_interval
        self._tls = tls
        #: The name the stage's certificate must carry, on every connection to it.
        self._server_name = tls_name(address) if tls is not None else None
        self._auth = tuple(auth)
        self._max_message_bytes = max_message_bytes
        self._options: list[tuple[str, str | int]] = [
            *server_options(max_message_bytes),
            # A stage that hangs is noticed within seconds: its unanswered pings close the connection.
            *keepalive_options(),
            # One layer of retries, ours: gRPC's would multiply with it.
            ("grpc.enable_retries", 0),
            # Its own connection per replica, even where another client dials the same address.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if self._server_name is not None:
            self._options.append(("grpc.ssl_target_name_override", self._server_name))
        #: Replica address -> its replica.
        self.by_address: dict[str, Replica] = {}
        self._watching = False
        self.listeners: list[Callable[[], None]] = []
        self.healthy = False
        self._ready_count = 0
        self._resolved = asyncio.Event() if not self.target.fixed else None
        self._resolver: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        if self.target.fixed:
            for fixed in self.target.fixed:
                self._add(fixed)
        #: The models the router's steps call here: where the stage has no health service, their
        #: `ModelReady` says whether it serves.
        self.models: set[str] = set()

    def _add(self, address: str) -> None:
        target = (
            address
            if self.target.fixed
            else (f"ipv6:{address}" if address.startswith("[") else f"ipv4:{address}")
        )
        if self._tls is None:
            channel = grpc.aio.insecure_channel(target, options=self._options)
            link = ServerLink(address, channel, self._auth, self._max_message_bytes)
        else:
            channel = grpc.aio.secure_channel(target, self._tls.credentials, options=self._options)
            link = ServerLink(
                address,
                channel,
                self._auth,
                self._max_message_bytes,
                tls=self._tls.ssl_context,
                server_name=self._server_name,
            )
        replica = Replica(address, channel, link)
        known = [r.latency for r in self.by_address.values() if r.sampled]
        if known:  # a newcomer is assumed as fast as the fastest, so it gets calls at once, not all of them
            replica.latency, replica.sampled = min(known), time.monotonic()
        self.by_address[address] = replica
        self._watch_all()

    def _watch_all(self) -> None:
        """Start the health watch of every replica that has none (once an event loop runs)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # made outside the loop: `start()` or the first call starts the watches
        self._watching = True
        for replica in self.by_address.values():
            if replica.watch is None:
                replica.watch = loop.create_task(self._watch(replica))

    def _remove(self, address: str) -> None:
        replica = self.by_address.pop(address)
        if replica.watch is not None:
            replica.watch.cancel()
        replica.link.close()
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
            log.info("stage '%s': cannot look up %s: %s", self.stage, self.target.host, err)
            addresses = None
        if addresses is not None:
            for address in addresses:
                if address not in self.by_address:
                    log.info("stage '%s': replica %s found", self.stage, address)
                    self._add(address)
            for address in [a for a in self.by_address if a not in addresses]:
                log.info("stage '%s': replica %s gone", self.stage, address)
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

    async def settle(self) -> None:
        """Before the first call: the name looked up once, and the health watches started."""
        if self._resolved is not None and not self._resolved.is_set():
            await self.refresh()
        if not self._watching:
            self._watch_all()

    async def _watch(self, replica: Replica) -> None:
        """Follow a replica's `grpc.health.v1` Watch: NOT_SERVING (loading, draining) takes it out of
        inference at once, SERVING puts it back; a broken stream marks it DOWN and is opened again. A
        server without the Watch RPC counts as serving. A hung replica is DOWN within seconds: its
        unanswered keepalive pings (`keepalive_options`) break the stream, and it cannot be opened again."""
        failures = 0
        request = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                # The stubs (types-grpcio-health-checking) declare HealthStub without its methods.
                async for reply in replica.health_stub.Watch(request):  # type: ignore[attr-defined]
                    failures = 0
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    self.set_state(replica, SERVING if serving else NOT_SERVING)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    await self._poll_protocol(replica)
                    return
                # NOTE: a stream that was healthy and ended is most often a connection the server recycled
                # (max_connection_age): watch again at once before calling the replica down, or a lone
                # replica would refuse calls for the length of a backoff every time it happens.
                if failures > 0 or replica.state != SERVING:
                    self.set_state(replica, DOWN)
            failures += 1
            if failures > 1:
                await asyncio.sleep(self.retry.backoff(min(failures - 1, 4)))

    async def _poll_protocol(self, replica: Replica, interval: float = 1.0) -> None:
        """A replica without a health service (the protocol does not require one): it serves while its
        `ServerReady` and the `ModelReady` of each of `models` say so, asked every `interval` seconds."""
        while True:
            self.set_state(replica, SERVING if await self._protocol_ready(replica, interval) else NOT_SERVING)
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
                self.set_state(replica, DOWN)
            return False
        return True

    def set_state(self, replica: Replica, state: str) -> None:
        replica.heard.set()
        if replica.state != state:
            if state == DOWN:
                replica.link.forget()
            replica.state = state
            self._changed()

    def _changed(self) -> None:
        ready = sum(1 for r in self.by_address.values() if r.state == SERVING)
        self.healthy = ready > 0
        if ready != self._ready_count:
            self._ready_count = ready
            for listener in self.listeners:
                listener()

    @property
    def ready_count(self) -> int:
        """Replicas whose health says SERVING now."""
        return self._ready_count

    def pick(self, method: str, tried: set[Replica], model: str = "", version: str = "") -> Replica | None:
        """The replica for the next call: among those not tried, SERVING ones (for inference), else those not
        heard from yet; for other RPCs, any that is up. Replicas of a stage may serve different models: a
        call for `model` goes to those whose `RepositoryIndex` lists it (at `version`), else to those that
        cannot say, and only where there are neither to one that does not list it (its answer says why). The
        lowest expected wait wins, ties at random."""
        infer = method == "ModelInfer"
        ranks = (SERVING, UNKNOWN) if infer else (SERVING, NOT_SERVING, UNKNOWN)
        untried = [r for r in self.by_address.values() if r not in tried]
        groups = [untried]
        if model:
            said = {r: r.serves(model, version) for r in untried}
            groups = [[r for r in untried if said[r]], [r for r in untried if said[r] is None]]
            if not any(groups):
                groups = [untried]
        now = time.monotonic()
        for rank in ranks:
            for group in groups:
                candidates = [r for r in group if r.state == rank]
                if candidates:
                    return min(candidates, key=lambda r: (r.cost(now), r.outstanding, random.random()))
        if not infer:  # metadata may still find a replica the health watch has not reached yet
            candidates = [r for group in groups for r in group]
            return random.choice(candidates) if candidates else None
        return None

    def rank(self, key: str, model: str = "", version: str = "") -> list[Replica]:
        """The replicas that may serve `model` (their `RepositoryIndex` lists it, or they cannot say) in the
        `rendezvous` order of their addresses for `key`, whatever their health: every router, and every
        worker of one, ranks alike, so the requests of one sequence meet on one replica."""
        candidates = [
            r for r in self.by_address.values() if not model or r.serves(model, version) is not False
        ]
        return sorted(candidates, key=lambda r: _weight(r.address, key), reverse=True)

    def serving(self, model: str) -> int:
        """The SERVING replicas that serve `model` (their `RepositoryIndex` lists it, or they cannot say)."""
        return sum(1 for r in self.by_address.values() if r.state == SERVING and r.serves(model) is not False)

    async def check_health(self, timeout: float) -> bool:
        """Whether any replica is SERVING, waiting up to `timeout` for replicas not heard from yet."""
        await self.settle()
        waiting = [r.heard.wait() for r in self.by_address.values() if not r.heard.is_set()]
        if waiting:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waiting), timeout)
        return self.healthy

    async def close(self) -> None:
        """Stop the look-ups and health watches and close every channel."""
        if self._resolver is not None:
            self._resolver.cancel()
        for replica in self.by_address.values():
            if replica.watch is not None:
                replica.watch.cancel()
            replica.link.close()
        await asyncio.gather(
            *(r.channel.close() for r in self.by_address.values()), *self._closing, return_exceptions=True
        )

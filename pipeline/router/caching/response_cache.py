"""The router's response cache: an earlier response, returned without running anything, for a request that
matches it exactly.

Triton's response cache in the router: a model (a stage model in its `config.pbtxt`, an ensemble in its
file) asks for it with `response_cache { enable: true }`, and the router's `--cache-size` (bytes, Triton's
`--cache-config local,size=N`) bounds it; entries are evicted least recently used first, and the size
counted for an entry is its serialised response, its key and a fixed allowance for the bookkeeping, so
the bytes held never pass the bound.

A request's key (`request_key`) is a BLAKE2b digest of everything that decides its answer: the model,
the versions that would answer it (an ensemble's: every step model's), each input's name, datatype, shape
and bytes, the outputs asked for, and the request parameters other than those that only schedule it
(`priority`, `timeout`) or only format it (`binary_data_output`, an output's `binary_data`). An entry
remembers the (model, version) pairs it came from, so that a version the stage stops serving takes its
entries with it (`drop`).

Identical requests that arrive together are computed once: the first computes, the others wait for its
response (within their own deadlines) and count as hits. Should it fail or be cancelled, the waiters do
not inherit its failure (their deadlines and cancellations are their own): one of them computes instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.codec import request_tensors
from pipeline.protocol.errors import DeadlineExceeded
from pipeline.runtime.metrics import Metrics

#: Request parameters that change when or how a response is delivered, never what it holds.
NEUTRAL_PARAMETERS = frozenset({"priority", "timeout", "binary_data_output"})
#: Output parameters of that kind (the HTTP side's binary or JSON output).
NEUTRAL_OUTPUT_PARAMETERS = frozenset({"binary_data"})
#: Bytes counted for an entry beyond its response and key: the dictionary slots, the entry object, the
#: version index. An estimate that errs high, so that the bound holds for what Python really allocates.
ENTRY_OVERHEAD = 256

#: A (model, version) pair an entry depends on.
Version = tuple[str, str]

_LENGTH = struct.Struct("<Q")


def request_key(model: str, versions: Iterable[Version], request: pb.ModelInferRequest) -> bytes:
    """The cache key of a request for `model` as answered by `versions` (see the module docstring)."""
    digest = hashlib.blake2b(digest_size=32)

    def add(data: bytes) -> None:
        # Length-prefixed, so that no two different sequences of fields hash the same bytes.
        digest.update(_LENGTH.pack(len(data)))
        digest.update(data)

    add(model.encode())
    for name, version in versions:
        add(name.encode())
        add(version.encode())
    add(b"inputs")
    for tensor in sorted(request_tensors(request), key=lambda t: t.name):
        add(tensor.name.encode())
        add(tensor.datatype.encode())
        add(struct.pack(f"<{len(tensor.shape)}q", *tensor.shape))
        add(tensor.raw)
    add(b"outputs")
    for output in request.outputs:
        add(output.name.encode())
        _add_parameters(add, output.parameters, NEUTRAL_OUTPUT_PARAMETERS)
    add(b"parameters")
    _add_parameters(add, request.parameters, NEUTRAL_PARAMETERS)
    return digest.digest()


def _add_parameters(add: Callable[[bytes], None], parameters, neutral: frozenset[str]) -> None:
    for key in sorted(parameters):
        if key not in neutral:
            add(key.encode())
            add(parameters[key].SerializeToString(deterministic=True))


@dataclass(slots=True)
class _Entry:
    response: bytes
    size: int
    versions: frozenset[Version]


#: What a waiter finds when the request it waited for failed: compute it yourself.
_FAILED = object()


class ResponseCache:
    """Serialised responses by request key, bounded in bytes, least recently used evicted first."""

    def __init__(self, capacity: int, metrics: Metrics | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"cache size must be > 0 bytes, got {capacity}")
        self.capacity = capacity
        self.metrics = metrics
        self.bytes = 0
        self.evictions = 0
        #: Requests waiting now for an identical request's response.
        self.waiting = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._by_version: dict[Version, set[bytes]] = {}
        self._inflight: dict[bytes, asyncio.Future[object]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def versions(self) -> set[Version]:
        """Every (model, version) some entry depends on."""
        return set(self._by_version)

    def get(self, key: bytes) -> bytes | None:
        """The response stored under `key` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.response

    def put(self, key: bytes, response: bytes, versions: Iterable[Version]) -> bool:
        """Store a response, evicting the least recently used entries until it fits; False when it is larger
        than the whole cache (then it is not stored)."""
        size = len(response) + len(key) + ENTRY_OVERHEAD
        if size > self.capacity:
            return False
        self._remove(key)
        while self.bytes + size > self.capacity:
            oldest = next(iter(self._entries))
            self._remove(oldest)
            self.evictions += 1
            if self.metrics is not None:
                self.metrics.cache_evictions.inc()
        entry = _Entry(response, size, frozenset(versions))
        self._entries[key] = entry
        self.bytes += size
        for version in entry.versions:
            self._by_version.setdefault(version, set()).add(key)
        return True

    def drop(self, model: str, version: str | None = None) -> int:
        """Drop every entry that depends on `model` at `version` (at any version when None); returns how
        many went."""
        pairs = [pair for pair in self._by_version if pair[0] == model and version in (None, pair[1])]
        keys = {key for pair in pairs for key in self._by_version.get(pair, ())}
        for key in keys:
            self._remove(key)
        return len(keys)

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.bytes -= entry.size
        for version in entry.versions:
            keys = self._by_version.get(version)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_version[version]

    async def fetch(
        self,
        key: bytes,
        compute: Callable[[], Awaitable[tuple[bytes, Iterable[Version]]]],
        *,
        deadline: float | None,
    ) -> tuple[bytes, bool, int]:
        """The response for `key`: from the cache, from an identical request in flight, or from `compute()`
        (which returns the serialised response and the versions that answered it), stored on the way.

        Returns the response, whether it was a hit (no computation by this request), and the nanoseconds this
        request spent in the cache itself (lookup, and insertion on a miss), which Triton's statistics report.
        `deadline` (`time.monotonic()`) bounds the wait for an identical request.
        """
        started = time.perf_counter_ns()
        while True:
            found = self.get(key)
            if found is not None:
                return found, True, time.perf_counter_ns() - started
            pending = self._inflight.get(key)
            if pending is None:
                break
            waited = time.perf_counter_ns()
            remaining = None if deadline is None else deadline - time.monotonic()
            self.waiting += 1
            try:
                # Shielded: a waiter that gives up must not cancel the computation the others wait for.
                result = await asyncio.wait_for(asyncio.shield(pending), remaining)
            except TimeoutError:
                raise DeadlineExceeded(
                    "deadline exceeded waiting for an identical request's response to be computed"
                ) from None
            finally:
                self.waiting -= 1
            started += time.perf_counter_ns() - waited  # the wait is not time spent in the cache
            if isinstance(result, bytes):
                return result, True, time.perf_counter_ns() - started
            # It failed: go round again, and compute it here unless another waiter already does.
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        looked_up = time.perf_counter_ns() - started
        try:
            response, versions = await compute()
        except BaseException:
            future.set_result(_FAILED)
            raise
        finally:
            del self._inflight[key]
        inserting = time.perf_counter_ns()
        self.put(key, response, versions)
        future.set_result(response)
        return response, False, looked_up + time.perf_counter_ns() - inserting

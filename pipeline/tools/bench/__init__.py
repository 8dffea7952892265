"""`pipeline bench`: load any Open Inference Protocol endpoint, gRPC or HTTP/REST, and report what it sustains.

In the spirit of Triton's perf_analyzer. Closed loop (`--concurrency 1,8,32`: N workers, each sending its next
request as soon as the previous one returns) or open loop (`--rate 500,1000`: arrivals at a set rate, Poisson
or evenly spaced, whether or not earlier requests have returned). Each level runs `--warmup` seconds, then is
measured for `--duration` seconds: a request counts in the interval when its response arrives inside it.

Inputs are synthesised from the model's `ModelMetadata` (random data of each input's datatype and shape,
`--batch` items in the batch dimension) or read from files. The request is serialised once and the same bytes
are sent every time, and responses are counted but not decoded, so the generator stays cheap; `--processes`
spreads the load over several processes when one cannot keep up.

Where the server lists `statistics` in `ServerMetadata.extensions`, Triton's `ModelStatistics` is read before
and after each measured interval and the differences are reported per model: requests, executions, mean
batch size, queue wait and compute time. Elsewhere only the client's own figures are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import struct
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.codec import Tensor
from pipeline.protocol.datatypes import DATATYPES
from pipeline.tools.bench.endpoints import (
    PROTOCOLS,
    Call,
    EndpointError,
    GrpcEndpoint,
    HttpEndpoint,
    open_endpoint,
)

#: The `ServerMetadata.extensions` entry that says `ModelStatistics` is served.
STATISTICS_EXTENSION = "statistics"
ARRIVALS = ("poisson", "constant")


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (bad options, unreachable server, inputs that cannot be made)."""


@dataclass(frozen=True, slots=True)
class Level:
    """One load level: a number of closed-loop workers, or an open-loop arrival rate (requests/s)."""

    kind: str  # "concurrency" or "rate"
    value: float

    @property
    def label(self) -> str:
        return f"concurrency {int(self.value)}" if self.kind == "concurrency" else f"rate {self.value:g}/s"


@dataclass
class BenchOptions:
    """What to measure and how; see `pipeline bench --help` for each field's meaning."""

    url: str
    model: str
    model_version: str = ""
    protocol: str = "grpc"
    concurrency: Sequence[int] = (1,)
    rates: Sequence[float] = ()
    arrival: str = "poisson"
    warmup: float = 2.0
    duration: float = 10.0
    batch: int = 1
    shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    #: Files per input; an input given several files sends them in turn (request i gets file i mod n).
    input_files: Mapping[str, Sequence[Path]] = field(default_factory=dict)
    #: The share of requests that send the first request's inputs again; the others send inputs never sent
    #: before. None: every request sends the same inputs (or the files in turn).
    repeat_share: float | None = None
    timeout: float = 30.0
    processes: int = 1
    #: gRPC connections per load process, calls spread over them in turn (a router with `--workers`
    #: spreads connections, not calls).
    connections: int = 1
    max_inflight: int = 10_000
    max_message_mb: int = 64
    seed: int = 0
    progress: bool = True
    #: Prometheus endpoints (name -> URL of /metrics) whose `process_cpu_seconds_total` is read around each
    #: measured interval: the CPU each request costs in each server process.
    cpu_metrics: Mapping[str, str] = field(default_factory=dict)
    #: The bearer token every call carries, where the server asks for one.
    token: str | None = None

    def levels(self) -> list[Level]:
        """The levels to run, in order: the rates when any are given, else the concurrencies."""
        if self.rates:
            return [Level("rate", float(r)) for r in self.rates]
        return [Level("concurrency", int(c)) for c in self.concurrency]

    def check(self) -> None:
        """Raise `BenchError` for options that cannot be run."""
        if self.rates and any(r <= 0 for r in self.rates):
            raise BenchError("--rate values must be > 0")
        if not self.rates and (not self.concurrency or any(c < 1 for c in self.concurrency)):
            raise BenchError("--concurrency values must be >= 1")
        if self.protocol not in PROTOCOLS:
            raise BenchError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.arrival not in ARRIVALS:
            raise BenchError(f"--arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.duration <= 0 or self.warmup < 0:
            raise BenchError("--duration must be > 0 and --warmup >= 0")
        if self.batch < 1 or self.processes < 1 or self.max_inflight < 1 or self.connections < 1:
            raise BenchError("--batch, --processes, --connections and --max-inflight must be >= 1")
        if self.repeat_share is not None:
            if not 0.0 <= self.repeat_share <= 1.0:
                raise BenchError(f"--repeat-share must be between 0 and 1, got {self.repeat_share}")
            if self.input_files:
                raise BenchError(
                    "--repeat-share makes unique inputs by writing a counter into the data, which would break "
                    "an input file's format: use it with synthesised inputs"
                )


@dataclass
class LevelResult:
    """What one level measured. Counts cover the whole level (warm-up included) unless `window_` says so."""

    level: Level
    duration: float
    batch: int
    sent: int = 0
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    window_ok: int = 0
    window_errors: Counter[str] = field(default_factory=Counter)
    #: Latencies in seconds of the successful responses that arrived in the measured interval.
    latencies: np.ndarray = field(default_factory=lambda: np.empty(0))
    #: Open loop: arrivals not sent because `max_inflight` requests were already outstanding.
    dropped: int = 0
    #: Per-model deltas of the server's statistics over the measured interval; None when not served.
    stages: dict[str, dict[str, Any]] | None = None
    #: Why `stages` is None although the server lists `statistics` (the RPC failed).
    stages_error: str | None = None
    #: CPU seconds each `cpu_metrics` process used over the measured interval (None: it could not be read).
    cpu_seconds: dict[str, float | None] = field(default_factory=dict)

    def cpu_us_per_request(self) -> dict[str, float | None]:
        """CPU microseconds per successful request in the measured interval, by process, and in all."""
        if not self.cpu_seconds or not self.window_ok:
            return {}
        per = {
            name: None if cpu is None else cpu * 1e6 / self.window_ok
            for name, cpu in self.cpu_seconds.items()
        }
        known = [v for v in per.values() if v is not None]
        per["all"] = sum(known) if len(known) == len(per) else None
        return per

    @property
    def responses(self) -> int:
        """Every response counted, successful or not."""
        return self.ok + sum(self.errors.values())

    @property
    def requests_per_s(self) -> float:
        return self.window_ok / self.duration

    @property
    def infer_per_s(self) -> float:
        return self.window_ok * self.batch / self.duration

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies, q) * 1e3) if self.latencies.size else math.nan

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        lat = self.latencies
        return {
            self.level.kind: int(self.level.value) if self.level.kind == "concurrency" else self.level.value,
            "duration_s": self.duration,
            "batch": self.batch,
            "sent": self.sent,
            "responses": self.responses,
            "ok": self.ok,
            "errors": dict(self.errors),
            "window": {"ok": self.window_ok, "errors": dict(self.window_errors)},
            "dropped": self.dropped,
            "throughput_infer_per_s": self.infer_per_s,
            "throughput_requests_per_s": self.requests_per_s,
            "latency_ms": {
                "p50": self.percentile_ms(50),
                "p90": self.percentile_ms(90),
                "p99": self.percentile_ms(99),
                "mean": float(lat.mean() * 1e3) if lat.size else math.nan,
                "min": float(lat.min() * 1e3) if lat.size else math.nan,
                "max": float(lat.max() * 1e3) if lat.size else math.nan,
            },
            "stages": self.stages,
            "stages_error": self.stages_error,
            "cpu_us_per_request": self.cpu_us_per_request(),
        }


@dataclass
class BenchReport:
    """A whole run: the server, the inputs sent and a result per level."""

    options: BenchOptions
    server: dict[str, Any]
    inputs: list[dict[str, Any]]
    results: list[LevelResult]

    @property
    def statistics(self) -> bool:
        return bool(self.server.get("statistics"))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (what `--json` writes)."""
        o = self.options
        return {
            "tool": "pipeline bench",
            "url": o.url,
            "protocol": o.protocol,
            "model": o.model,
            "model_version": o.model_version,
            "mode": "rate" if o.rates else "concurrency",
            "arrival": o.arrival if o.rates else None,
            "batch": o.batch,
            "warmup_s": o.warmup,
            "duration_s": o.duration,
            "processes": o.processes,
            "repeat_share": o.repeat_share,
            "connections": o.connections,
            "server": self.server,
            "inputs": self.inputs,
            "results": [r.to_dict() for r in self.results],
        }


# --------------------------------------------------------------------------------------------------------
# Inputs


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """`NAME=d1,d2` → (NAME, (d1, d2))."""
    name, sep, dims = text.partition("=")
    try:
        shape = tuple(int(d) for d in dims.split(",") if d.strip())
    except ValueError:
        shape = ()
    if not sep or not name or not shape or any(d < 0 for d in shape):
        raise BenchError(f"--shape expects NAME=d1,d2,... with dims >= 0, got {text!r}")
    return name, shape


def _resolve_shape(
    tensor: pb.ModelMetadataResponse.TensorMetadata, batching: bool, batch: int, fixed: Sequence[int] | None
) -> tuple[int, ...]:
    dims = list(tensor.shape)
    rest = dims[1:] if batching else dims
    if fixed is not None:
        if len(fixed) != len(rest):
            raise BenchError(
                f"--shape {tensor.name}: the model's shape {dims} has {len(rest)} non-batch dims, "
                f"got {list(fixed)}"
            )
        rest = [want if d == -1 else d for d, want in zip(rest, fixed, strict=True)]
    if any(d < 0 for d in rest):
        raise BenchError(
            f"input {tensor.name} has variable dims ({dims}); fix them with --shape {tensor.name}=d1,d2,..."
        )
    return (batch, *rest) if batching else tuple(rest)


def _random_array(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = DATATYPES[datatype]
    if datatype == "BYTES":
        out = np.empty(shape, dtype=object)
        flat = out.reshape(-1)
        for i in range(flat.size):
            flat[i] = rng.bytes(16)
        return out
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(size=shape).astype(dtype)


def synthesize_inputs(
    metadata: pb.ModelMetadataResponse,
    *,
    batching: bool,
    batch: int = 1,
    shapes: Mapping[str, Sequence[int]] | None = None,
    files: Mapping[str, Path] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """One request's inputs, by name: from `files` where given, else random data of the declared type.

    A `.npy` file is the whole tensor as sent. Any other file is one BYTES element, repeated over the shape.
    `batching` says whether dim 0 is the batch dimension (then it is `batch`); `shapes` fixes the other
    variable dims, as Triton's perf_analyzer's `--shape` does.
    """
    shapes, files = shapes or {}, files or {}
    known = {t.name for t in metadata.inputs}
    for name in (*shapes, *files):
        if name not in known:
            raise BenchError(f"model '{metadata.name}' has no input {name!r} (inputs: {', '.join(known)})")
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for tensor in metadata.inputs:
        path = files.get(tensor.name)
        if path is not None and path.suffix == ".npy":
            arrays[tensor.name] = _load_npy(path, tensor.datatype)
            continue
        shape = _resolve_shape(tensor, batching, batch, shapes.get(tensor.name))
        if path is None:
            arrays[tensor.name] = _random_array(tensor.datatype, shape, rng)
        elif tensor.datatype != "BYTES":
            raise BenchError(f"--input-file {tensor.name}: a {tensor.datatype} input needs a .npy file")
        else:
            data = path.read_bytes()
            array = np.empty(shape, dtype=object)
            array.reshape(-1)[:] = [data] * array.size
            arrays[tensor.name] = array
    return arrays


def _load_npy(path: Path, datatype: str) -> np.ndarray:
    """A `.npy` file's tensor, read without pickle. BYTES come from an array of fixed-width byte strings
    (`np.array([b"...", ...])`, dtype `S`) or of text (dtype `U`, sent as UTF-8)."""
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise BenchError(
            f"--input-file {path}: {exc}; BYTES inputs must be saved as byte strings (dtype S) or text "
            "(dtype U), not as Python objects"
        ) from None
    if datatype != "BYTES":
        return array
    if array.dtype.kind not in ("S", "U"):
        raise BenchError(
            f"--input-file {path}: a BYTES input needs byte strings or text, got dtype {array.dtype}"
        )
    elements = [e.encode() if isinstance(e, str) else bytes(e) for e in array.reshape(-1).tolist()]
    objects = np.empty(array.shape, dtype=object)
    objects.reshape(-1)[:] = elements
    return objects


_STAMP = struct.Struct("<Q")


@dataclass
class Payloads:
    """What the load sends, request by request: `items` in turn; or, with `repeat_share`, the first item
    again for that share of the requests (drawn at random) and, for the others, the first item with a
    counter written into its last 8 bytes (the end of the last input's data), so that no two are alike.

    `salt` keeps the counters of several load processes apart.
    """

    items: Sequence[Any]
    repeat_share: float | None = None
    seed: int = 0
    salt: int = 0

    def __post_init__(self) -> None:
        self._sent = 0
        self._rng = np.random.default_rng(self.seed)

    def next(self) -> Any:
        """The next request's payload."""
        self._sent += 1
        if self.repeat_share is None:
            return self.items[(self._sent - 1) % len(self.items)]
        first = self.items[0]
        if self._rng.random() < self.repeat_share:
            return first
        stamp = _STAMP.pack((self.salt << 48) | self._sent)
        if isinstance(first, tuple):  # HTTP: (body, header length)
            return first[0][: -len(stamp)] + stamp, first[1]
        return first[: -len(stamp)] + stamp


def build_request(model: str, version: str, arrays: Mapping[str, np.ndarray]) -> pb.ModelInferRequest:
    """The request every call sends: all inputs as raw contents."""
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    for name, array in arrays.items():
        tensor = Tensor.from_array(name, array)
        request.inputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
        request.raw_input_contents.append(tensor.raw)
    return request


# --------------------------------------------------------------------------------------------------------
# The load


class _Tally:
    """Counters shared by one process's workers (all on one event loop, so no locks)."""

    __slots__ = ("dropped", "errors", "latencies", "ok", "sent", "window_errors")

    def __init__(self) -> None:
        self.sent = self.ok = self.dropped = 0
        self.errors: Counter[str] = Counter()
        self.window_errors: Counter[str] = Counter()
        self.latencies: list[float] = []

    def raw(self) -> dict[str, Any]:
        """A picklable summary, to send from a worker process."""
        return {
            "sent": self.sent,
            "ok": self.ok,
            "dropped": self.dropped,
            "errors": dict(self.errors),
            "window_errors": dict(self.window_errors),
            "latencies": np.asarray(self.latencies, dtype=np.float64),
        }


def _error_code(err: BaseException) -> str:
    if isinstance(err, EndpointError):
        return err.code
    return f"CLIENT_{type(err).__name__}"


async def drive(
    call: Call,
    payload: Any,
    level: Level,
    *,
    start: float,
    warmup: float,
    duration: float,
    timeout: float,
    max_inflight: int = 10_000,
    seed: int = 0,
    tally: _Tally | None = None,
) -> _Tally:
    """Send `payload` through `call` at `level` from `start` (a `time.perf_counter` instant) and count.

    Every request sent gets exactly one count, in `ok` or in `errors` by status code: sending stops at the
    end of the interval and in-flight requests are awaited. Latencies are kept for the successes whose
    response arrives in the measured interval; in the open loop they run from the scheduled arrival, so a
    generator that falls behind shows up in them instead of hiding it.
    """
    tally = tally if tally is not None else _Tally()
    now = time.perf_counter
    t_meas = start + warmup
    t_stop = t_meas + duration
    latencies = tally.latencies
    errors, window_errors = tally.errors, tally.window_errors
    delay = start - now()
    if delay > 0:
        await asyncio.sleep(delay)

    payloads = payload if isinstance(payload, Payloads) else Payloads([payload])

    async def one(t0: float) -> None:
        try:
            await call(payloads.next(), timeout)
        except Exception as err:  # every failure is a counted outcome, never a crash of the generator
            code = _error_code(err)
            errors[code] += 1
            if t_meas <= now() <= t_stop:
                window_errors[code] += 1
            return
        t1 = now()
        tally.ok += 1
        if t_meas <= t1 <= t_stop:
            latencies.append(t1 - t0)

    if level.kind == "concurrency":

        async def worker() -> None:
            while (t0 := now()) < t_stop:
                tally.sent += 1
                await one(t0)

        await asyncio.gather(*(worker() for _ in range(int(level.value))))
        return tally

    if level.value <= 0:
        return tally
    rng = np.random.default_rng(seed)
    chunk = max(64, int(level.value))
    pending: set[asyncio.Task[None]] = set()
    scheduled = start
    while True:
        gaps = rng.exponential(1.0 / level.value, chunk) if level.kind == "rate" else None
        for i in range(chunk):
            scheduled += 1.0 / level.value if gaps is None else float(gaps[i])
            if scheduled >= t_stop:
                break
            wait = scheduled - now()
            if wait > 0:
                await asyncio.sleep(wait)
            if len(pending) >= max_inflight:
                tally.dropped += 1
                continue
            tally.sent += 1
            task = asyncio.create_task(one(scheduled))
            pending.add(task)
            task.add_done_callback(pending.discard)
        else:
            continue
        break
    if pending:
        await asyncio.gather(*pending)
    return tally


def _open_loop(level: Level, arrival: str) -> Level:
    # Constant arrivals reuse the "rate" level with evenly spaced gaps; `drive` tells them apart by kind.
    return Level("constant", level.value) if level.kind == "rate" and arrival == "constant" else level


def _share(level: Level, processes: int) -> list[Level]:
    """Split a level over worker processes: concurrency as evenly as whole workers allow, rate evenly."""
    if level.kind == "concurrency":
        total = int(level.value)
        return [Level("concurrency", total // processes + (i < total % processes)) for i in range(processes)]
    return [Level(level.kind, level.value / processes) for _ in range(processes)]


# --------------------------------------------------------------------------------------------------------
# Server statistics


async def read_statistics(endpoint: GrpcEndpoint | HttpEndpoint) -> dict[str, pb.ModelStatistics]:
    """Every model's cumulative statistics, by "name" (or "name:version" past the first version)."""
    response = await endpoint.statistics()
    out: dict[str, pb.ModelStatistics] = {}
    for stats in response.model_stats:
        key = stats.name if stats.name not in out else f"{stats.name}:{stats.version}"
        out[key] = stats
    return out


def statistics_delta(
    before: Mapping[str, pb.ModelStatistics], after: Mapping[str, pb.ModelStatistics]
) -> dict[str, dict[str, Any]]:
    """What each model did between two `ModelStatistics` readings, as perf_analyzer reports it.

    Per model with any activity: requests (`inference_count`), executions (`execution_count`), the mean
    batch size (from `batch_stats`, else requests / executions), and the mean queue wait and compute phases
    per request (from `inference_stats`), in microseconds; `batch_sizes` counts executions by batch size.
    """
    report: dict[str, dict[str, Any]] = {}
    for key, a in after.items():
        b = before.get(key) or pb.ModelStatistics()
        inferences = a.inference_count - b.inference_count
        executions = a.execution_count - b.execution_count
        if inferences == 0 and executions == 0:
            continue

        def mean_us(name: str, a: pb.ModelStatistics = a, b: pb.ModelStatistics = b) -> float | None:
            new, old = getattr(a.inference_stats, name), getattr(b.inference_stats, name)
            count = new.count - old.count
            return (new.ns - old.ns) / count / 1e3 if count else None

        old_batches = {s.batch_size: s.compute_infer.count for s in b.batch_stats}
        sizes = {
            int(s.batch_size): s.compute_infer.count - old_batches.get(s.batch_size, 0) for s in a.batch_stats
        }
        sizes = {size: n for size, n in sorted(sizes.items()) if n > 0}
        mean_batch: float | None
        if sizes:
            mean_batch = sum(size * n for size, n in sizes.items()) / sum(sizes.values())
        else:
            mean_batch = inferences / executions if executions else None
        report[key] = {
            "version": a.version,
            "inference_count": inferences,
            "execution_count": executions,
            "success_count": a.inference_stats.success.count - b.inference_stats.success.count,
            "fail_count": a.inference_stats.fail.count - b.inference_stats.fail.count,
            "mean_batch_size": mean_batch,
            "queue_us": mean_us("queue"),
            "compute_input_us": mean_us("compute_input"),
            "compute_infer_us": mean_us("compute_infer"),
            "compute_output_us": mean_us("compute_output"),
            "cache_hits": a.inference_stats.cache_hit.count - b.inference_stats.cache_hit.count,
            "cache_misses": a.inference_stats.cache_miss.count - b.inference_stats.cache_miss.count,
            "batch_sizes": sizes,
        }
    return report


# --------------------------------------------------------------------------------------------------------
# Worker processes (--processes N)


def _child_main(conn: Any, options: BenchOptions, payload: Any) -> None:
    """A load process: connects, says "ready", then runs each level it is sent until it is sent None."""
    asyncio.run(_child_loop(conn, options, payload))


async def _child_loop(conn: Any, options: BenchOptions, payload: Any) -> None:
    loop = asyncio.get_running_loop()
    endpoint = _endpoint(options)
    try:
        call = endpoint.call()
        await endpoint.ready()
        conn.send("ready")
        while (command := await loop.run_in_executor(None, conn.recv)) is not None:
            level, start_wall, kwargs = command
            # Processes share wall-clock time, not perf_counter origins: convert once.
            start = time.perf_counter() + (start_wall - time.time())
            tally = await drive(call, payload, level, start=start, **kwargs)
            conn.send(tally.raw())
    finally:
        await endpoint.close()


class _Pool:
    """Worker processes that run each level's share of the load, started once for the whole run."""

    def __init__(self, count: int, options: BenchOptions, payload: Any) -> None:
        context = multiprocessing.get_context("spawn")  # fork and gRPC's threads do not mix
        self.conns = []
        self.processes = []
        for index in range(count):
            parent, child = context.Pipe()
            if isinstance(payload, Payloads):
                payload = dataclasses.replace(payload, salt=index + 1)
            process = context.Process(target=_child_main, args=(child, options, payload), daemon=True)
            process.start()
            self.conns.append(parent)
            self.processes.append(process)

    async def ready(self, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        for conn, process in zip(self.conns, self.processes, strict=True):
            if not await loop.run_in_executor(None, conn.poll, timeout):
                raise BenchError(f"load process {process.pid} did not start within {timeout:.0f}s")
            conn.recv()

    async def run(self, levels: Sequence[Level], start_wall: float, kwargs: dict[str, Any]) -> list[dict]:
        loop = asyncio.get_running_loop()
        for conn, level in zip(self.conns, levels, strict=True):
            conn.send((level, start_wall, kwargs))
        return list(await asyncio.gather(*(loop.run_in_executor(None, c.recv) for c in self.conns)))

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


# --------------------------------------------------------------------------------------------------------
# The run


def _endpoint(options: BenchOptions) -> GrpcEndpoint | HttpEndpoint:
    return open_endpoint(
        options.protocol,
        options.url,
        model=options.model,
        version=options.model_version,
        max_message_bytes=options.max_message_mb * 1024 * 1024,
        connections=options.connections,
        token=options.token,
    )


async def _server_info(endpoint: GrpcEndpoint | HttpEndpoint, model: str, version: str) -> tuple:
    try:
        server = await endpoint.server_metadata()
        metadata = await endpoint.model_metadata(model, version)
    except EndpointError as err:
        raise BenchError(f"cannot read the metadata of '{model}': {err.code}: {err.message}") from None
    batching: bool | None = None
    with contextlib.suppress(EndpointError):  # ModelConfig is Triton's extension, not core OIP
        config = await endpoint.model_config(model, version)
        batching = config.max_batch_size > 0
    if batching is None:
        batching = bool(metadata.inputs) and all(t.shape and t.shape[0] == -1 for t in metadata.inputs)
    return server, metadata, batching


async def run_bench(options: BenchOptions) -> BenchReport:
    """Measure every level of `options` and return the report (nothing printed but the progress bar)."""
    options.check()
    endpoint = _endpoint(options)
    try:
        server, metadata, batching = await _server_info(endpoint, options.model, options.model_version)
        turns = max((len(paths) for paths in options.input_files.values()), default=1)
        requests = []
        for turn in range(turns):
            arrays = synthesize_inputs(
                metadata,
                batching=batching,
                batch=options.batch,
                shapes=options.shapes,
                files={name: paths[turn % len(paths)] for name, paths in options.input_files.items()},
                seed=options.seed,
            )
            requests.append(endpoint.payload(build_request(options.model, options.model_version, arrays)))
        batch = options.batch if batching else 1
        if (
            options.repeat_share is not None
            and len(requests[0] if isinstance(requests[0], bytes) else requests[0][0]) < 8
        ):
            raise BenchError("--repeat-share needs requests of at least 8 bytes of input data")
        payload = Payloads(requests, options.repeat_share, options.seed)
        with_stats = STATISTICS_EXTENSION in server.extensions
        server_info = {
            "name": server.name,
            "version": server.version,
            "extensions": list(server.extensions),
            "statistics": with_stats,
        }
        inputs = [
            {"name": name, "datatype": Tensor.from_array(name, a).datatype, "shape": list(a.shape)}
            for name, a in arrays.items()
        ]
        call = endpoint.call()
        pool = _Pool(options.processes, options, payload) if options.processes > 1 else None
        try:
            if pool is not None:
                await pool.ready()
            results = []
            levels = options.levels()
            with _Progress(options, levels) as progress:
                for i, level in enumerate(levels):
                    result = await _run_level(
                        options, level, call, payload, endpoint if with_stats else None, pool, progress, i
                    )
                    result.batch = batch
                    results.append(result)
        finally:
            if pool is not None:
                pool.close()
    except OSError as err:  # the server cannot be reached at all
        raise BenchError(f"cannot reach {options.url} over {options.protocol}: {err}") from None
    finally:
        await endpoint.close()
    return BenchReport(options, server_info, inputs, results)


async def read_process_cpu(endpoints: Mapping[str, str]) -> dict[str, float | None]:
    """`process_cpu_seconds_total` of each Prometheus endpoint (name -> /metrics URL); None where it cannot
    be read."""
    from prometheus_client.parser import text_string_to_metric_families

    def read(url: str) -> float | None:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                text = reply.read().decode()
        except (OSError, ValueError):
            return None
        for family in text_string_to_metric_families(text):
            if family.name == "process_cpu_seconds":
                return sum(sample.value for sample in family.samples)
        return None

    values = await asyncio.gather(*(asyncio.to_thread(read, url) for url in endpoints.values()))
    return dict(zip(endpoints, values, strict=True))


async def _run_level(
    options: BenchOptions,
    level: Level,
    call: Call,
    payload: Any,
    stats_endpoint: GrpcEndpoint | HttpEndpoint | None,
    pool: _Pool | None,
    progress: _Progress,
    index: int,
) -> LevelResult:
    lead = 0.2 if pool is not None else 0.0  # time for every process to receive its orders
    start = time.perf_counter() + lead
    open_level = _open_loop(level, options.arrival)
    kwargs: dict[str, Any] = {
        "warmup": options.warmup,
        "duration": options.duration,
        "timeout": options.timeout,
        "max_inflight": options.max_inflight,
    }
    tally = _Tally()
    stats_error: list[str] = []

    async def statistics() -> dict[str, dict[str, Any]] | None:
        if stats_endpoint is None:
            return None
        try:
            await asyncio.sleep(max(0.0, start + options.warmup - time.perf_counter()))
            before = await read_statistics(stats_endpoint)
            await asyncio.sleep(max(0.0, start + options.warmup + options.duration - time.perf_counter()))
            # Responses still in flight at the end belong to the interval by the server's clock: wait for them.
            while pool is None and tally.sent > tally.ok + sum(tally.errors.values()):
                await asyncio.sleep(0.01)
            return statistics_delta(before, await read_statistics(stats_endpoint))
        except EndpointError as err:  # the load goes on; only the server's side is missing
            stats_error.append(f"ModelStatistics failed: {err.code}: {err.message}")
            return None

    async def cpu() -> dict[str, float | None]:
        if not options.cpu_metrics:
            return {}
        await asyncio.sleep(max(0.0, start + options.warmup - time.perf_counter()))
        before = await read_process_cpu(options.cpu_metrics)
        await asyncio.sleep(max(0.0, start + options.warmup + options.duration - time.perf_counter()))
        after = await read_process_cpu(options.cpu_metrics)
        return {
            name: None if before[name] is None or after[name] is None else after[name] - before[name]  # type: ignore[operator]
            for name in before
        }

    stats_task = asyncio.create_task(statistics())
    cpu_task = asyncio.create_task(cpu())
    ticker = asyncio.create_task(progress.follow(index, start, tally if pool is None else None))
    try:
        if pool is None:
            await drive(call, payload, open_level, start=start, seed=options.seed, tally=tally, **kwargs)
            raws = [tally.raw()]
        else:
            shares = _share(open_level, options.processes)
            start_wall = time.time() + lead
            raws = await pool.run(shares, start_wall, {**kwargs, "seed": options.seed})
        stages = await stats_task
        cpu_seconds = await cpu_task
    finally:
        ticker.cancel()
        stats_task.cancel()
        cpu_task.cancel()
    result = LevelResult(level, options.duration, options.batch, stages=stages, cpu_seconds=cpu_seconds)
    result.stages_error = stats_error[0] if stats_error else None
    for raw in raws:
        result.sent += raw["sent"]
        result.ok += raw["ok"]
        result.dropped += raw["dropped"]
        result.errors.update(raw["errors"])
        result.window_errors.update(raw["window_errors"])
    result.latencies = np.sort(np.concatenate([raw["latencies"] for raw in raws]))
    result.window_ok = int(result.latencies.size)
    return result


class _Progress:
    """A tqdm bar over the run's seconds, with the level and the responses so far (stderr)."""

    def __init__(self, options: BenchOptions, levels: Sequence[Level]) -> None:
        self.levels = levels
        self.per_level = options.warmup + options.duration
        self.enabled = options.progress
        self.bar: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from tqdm import tqdm

            total = self.per_level * len(self.levels)
            self.bar = tqdm(total=round(total, 1), unit="s", desc="bench", leave=False, file=sys.stderr)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    async def follow(self, index: int, start: float, tally: _Tally | None) -> None:
        if self.bar is None:
            return
        while True:
            elapsed = min(self.per_level, max(0.0, time.perf_counter() - start))
            self.bar.n = round(index * self.per_level + elapsed, 1)
            postfix = self.levels[index].label
            if tally is not None:
                postfix += f", {tally.ok} ok, {sum(tally.errors.values())} errors"
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.refresh()
            await asyncio.sleep(0.5)


# --------------------------------------------------------------------------------------------------------
# Output


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def format_report(report: BenchReport) -> str:
    """The tables `pipeline bench` prints: one row per level, then each level's per-model figures."""
    o = report.options
    kind = "rate/s" if o.rates else "concurrency"
    lines = [
        f"{o.model} at {o.url} ({o.protocol}): batch {report.results[0].batch if report.results else o.batch}, "
        f"{o.warmup:g} s warm-up + {o.duration:g} s measured per level"
        + (f", {o.arrival} arrivals" if o.rates else "")
        + (f", {o.processes} processes" if o.processes > 1 else "")
        + (f", {o.repeat_share:.0%} repeated inputs" if o.repeat_share is not None else ""),
        "",
        f"{kind:>11} {'infer/s':>10} {'req/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
        f"{'sent':>8} {'ok':>8}  errors",
    ]
    for r in report.results:
        errors = ", ".join(f"{code} {n}" for code, n in sorted(r.errors.items())) or "-"
        if r.dropped:
            errors += f" (dropped {r.dropped}: --max-inflight reached)"
        lines.append(
            f"{r.level.value:>11g} {r.infer_per_s:>10,.1f} {r.requests_per_s:>10,.1f} "
            f"{_fmt(r.percentile_ms(50), 2):>8} {_fmt(r.percentile_ms(90), 2):>8} "
            f"{_fmt(r.percentile_ms(99), 2):>8} {r.sent:>8} {r.ok:>8}  {errors}"
        )
    for r in report.results:
        per = r.cpu_us_per_request()
        if per:
            lines += [
                "",
                f"CPU per request over the measured interval, {r.level.label} (process_cpu_seconds_total):",
                "  " + ", ".join(f"{name} {_fmt(us, 0)} us" for name, us in per.items()),
            ]
    if not report.statistics:
        lines += ["", "(the server does not list 'statistics' in its extensions: client-side figures only)"]
        return "\n".join(lines)
    for r in report.results:
        lines += [
            "",
            f"server statistics over the measured interval, {r.level.label}:",
            f"  {'model':<28} {'requests':>9} {'execs':>8} {'batch':>6} {'queue us':>9} "
            f"{'compute us':>10} {'infer us':>9} {'cache hit':>9}",
        ]
        if r.stages_error:
            lines[-1] = f"  ({r.stages_error}: client-side figures only)"
        for name, s in (r.stages or {}).items():
            compute = [s.get(k) for k in ("compute_input_us", "compute_infer_us", "compute_output_us")]
            total = sum(v for v in compute if v is not None) if any(v is not None for v in compute) else None
            lines.append(
                f"  {name:<28} {s['inference_count']:>9} {s['execution_count']:>8} "
                f"{_fmt(s['mean_batch_size']):>6} {_fmt(s['queue_us']):>9} {_fmt(total):>10} "
                f"{_fmt(s['compute_infer_us']):>9} {_hit_share(s):>9}"
            )
    return "\n".join(lines)


def _hit_share(stats: Mapping[str, Any]) -> str:
    lookups = stats.get("cache_hits", 0) + stats.get("cache_misses", 0)
    return f"{stats['cache_hits'] / lookups:.0%}" if lookups else "-"


def write_json(report: BenchReport, path: Path) -> None:
    """Write the report's JSON form (NaN as null, so any JSON reader takes it)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    path.write_text(json.dumps(clean(report.to_dict()), indent=2) + "\n")


def write_plot(report: BenchReport, path: Path) -> None:
    """Throughput and p99 latency against the load level, as a PNG. Needs matplotlib (extra `bench`)."""
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'pipeline-serving[bench]'") from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    x = [r.level.value for r in report.results]
    xlabel = "arrival rate (requests/s)" if report.options.rates else "concurrency"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    try:
        left.plot(x, [r.infer_per_s for r in report.results], marker="o")
        left.set(xlabel=xlabel, ylabel="throughput (infer/s)", title="throughput")
        right.plot(x, [r.percentile_ms(99) for r in report.results], marker="o", color="tab:red")
        right.set(xlabel=xlabel, ylabel="p99 latency (ms)", title="p99 latency")
        for axis in (left, right):
            axis.grid(True, alpha=0.3)
            axis.set_ylim(bottom=0)
            if not report.options.rates and len(x) > 1 and max(x) / min(x) >= 8:
                axis.set_xscale("log", base=2)
                axis.set_xticks(x, [f"{v:g}" for v in x])
        fig.suptitle(f"{report.options.model} at {report.options.url} (batch {report.options.batch})")
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------------------------------------
# Command line


def _numbers(kind: type) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pipeline bench`."""
    parser.add_argument(
        "--url",
        "-u",
        default=os.environ.get("PIPELINE_URL", "127.0.0.1:8001"),
        help="host:port of any OIP endpoint: the router or a stage over gRPC, the router's HTTP port over "
        "http (env PIPELINE_URL)",
    )
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="grpc",
        help="the protocol's gRPC side, or its HTTP/REST side with binary tensor data (default grpc)",
    )
    parser.add_argument("--model", "-m", required=True, help="model or ensemble name")
    parser.add_argument("--model-version", default="", help="version (default: the server's default)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=_numbers(int),
        default=[1],
        help="closed loop: comma-separated numbers of concurrent workers (default 1)",
    )
    load.add_argument(
        "--rate",
        type=_numbers(float),
        default=[],
        help="open loop: comma-separated arrival rates (requests/s)",
    )
    parser.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="open-loop arrivals")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring each level")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    parser.add_argument("--batch", "-b", type=int, default=1, help="items per request (the batch dimension)")
    parser.add_argument(
        "--shape", action="append", default=[], metavar="NAME=d1,d2", help="fix an input's variable dims"
    )
    parser.add_argument(
        "--input-file",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="an input's data: a .npy file is the whole tensor; any other file is one BYTES element. Given "
        "several times for one input, requests send the files in turn (a mixed workload: repeat a file to "
        "weigh it)",
    )
    parser.add_argument(
        "--repeat-share",
        type=float,
        default=None,
        metavar="S",
        help="a workload for a response cache: this share (0..1) of the requests repeats one same input, the "
        "others send inputs never sent before (synthesised inputs only)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of each request, in seconds")
    parser.add_argument("--processes", type=int, default=1, help="load processes (when one cannot keep up)")
    parser.add_argument(
        "--connections",
        type=int,
        default=1,
        help="gRPC connections per load process, calls spread over them in turn (a router with --workers "
        "spreads connections over its processes, not calls)",
    )
    parser.add_argument(
        "--max-inflight", type=int, default=10_000, help="open loop: most outstanding requests (then drop)"
    )
    parser.add_argument("--max-message-mb", type=int, default=64, help="largest message, in MiB")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs and arrivals")
    parser.add_argument(
        "--cpu",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a server process's Prometheus /metrics URL (repeatable; `pipeline run` prints them): its "
        "process_cpu_seconds_total is read around each measured interval, giving CPU microseconds per request",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("PIPELINE_TOKEN") or None,
        help="bearer token sent with every call, where the server asks for one (env PIPELINE_TOKEN)",
    )
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--plot", type=Path, help="write throughput and p99 latency against load as a PNG")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """`BenchOptions` from parsed `pipeline bench` flags."""
    files: dict[str, list[Path]] = {}
    for item in args.input_file:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise BenchError(f"--input-file expects NAME=PATH, got {item!r}")
        files.setdefault(name, []).append(Path(path))
    cpu = {}
    for item in args.cpu:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise BenchError(f"--cpu expects NAME=URL, got {item!r}")
        cpu[name] = url if "://" in url else f"http://{url}/metrics"
    return BenchOptions(
        url=args.url,
        model=args.model,
        model_version=args.model_version,
        protocol=args.protocol,
        concurrency=args.concurrency,
        rates=args.rate,
        arrival=args.arrival,
        warmup=args.warmup,
        duration=args.duration,
        batch=args.batch,
        shapes=dict(parse_shape(s) for s in args.shape),
        input_files=files,
        repeat_share=args.repeat_share,
        timeout=args.timeout,
        processes=args.processes,
        connections=args.connections,
        max_inflight=args.max_inflight,
        max_message_mb=args.max_message_mb,
        seed=args.seed,
        progress=args.progress,
        cpu_metrics=cpu,
        token=args.token,
    )


def run_bench_command(args: argparse.Namespace) -> int:
    """`pipeline bench`: measure, print the tables, write the JSON and the plot; returns the exit code."""
    try:
        options = options_from_args(args)
        report = asyncio.run(run_bench(options))
        print(format_report(report), flush=True)
        if args.json:
            write_json(report, args.json)
        if args.plot:
            write_plot(report, args.plot)
    except BenchError as err:
        print(f"pipeline bench: {err}", file=sys.stderr)
        return 2
    return 0

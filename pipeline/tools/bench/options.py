"""What `pipeline bench` measures and how: the options of a run, its load levels, and the error it stops with."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.runtime.security import client_tls
from pipeline.tools.bench.endpoints import PROTOCOLS, Call, GrpcEndpoint, HttpEndpoint, open_endpoint

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
    #: Inputs given one value each (`--value NAME=VALUE`), which fills the input's shape.
    values: Mapping[str, str] = field(default_factory=dict)
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
    #: TLS (PEM files): the CA that turns it on, and a client certificate for servers that require one.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Each request over a `ModelStreamInfer` stream of its own, its many responses timed (gRPC only).
    stream: bool = False

    def levels(self) -> list[Level]:
        """The levels to run, in order: the rates when any are given, else the concurrencies."""
        if self.rates:
            return [Level("rate", float(r)) for r in self.rates]
        return [Level("concurrency", int(c)) for c in self.concurrency]

    def endpoint(self) -> GrpcEndpoint | HttpEndpoint:
        """A new endpoint at `url` over `protocol`, as these options ask (message size, connections, token)."""
        return open_endpoint(
            self.protocol,
            self.url,
            model=self.model,
            version=self.model_version,
            max_message_bytes=self.max_message_mb * 1024 * 1024,
            connections=self.connections,
            token=self.token,
            tls=client_tls(self.tls_ca, self.tls_cert, self.tls_key),
        )

    def call(self, endpoint: GrpcEndpoint | HttpEndpoint) -> Call:
        """The call the load makes at `endpoint`: a streamed one with `stream` (which `check` allows over
        gRPC only), else a unary one."""
        if self.stream and isinstance(endpoint, GrpcEndpoint):
            return endpoint.stream_call()
        return endpoint.call()

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
        if self.stream and self.protocol != "grpc":
            raise BenchError("--stream needs --protocol grpc: streams are gRPC's ModelStreamInfer")
        if self.repeat_share is not None:
            if not 0.0 <= self.repeat_share <= 1.0:
                raise BenchError(f"--repeat-share must be between 0 and 1, got {self.repeat_share}")
            if self.input_files:
                raise BenchError(
                    "--repeat-share makes unique inputs by writing a counter into the data, which would break "
                    "an input file's format: use it with synthesised inputs"
                )

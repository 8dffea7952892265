"""Where a lone request's time goes, hop by hop: the refcnn pipeline (batching on, through the compiled front) at
one request in flight under the peers' load generator, its processes' socket reads and writes
recorded by `perf trace` for a few seconds and read back as each request's path through the five processes:

    client -> front -> router -> preprocess -> router -> model -> router -> postprocess -> router -> front -> client

    python -m bench.hops --peers DIR [--trace-seconds 3] [--warmup 2] [--duration 10]

Each row is the median (and the 10th and 90th percentiles) over the requests traced of the time from one
process's read of a request's bytes to its write of them onward (its work on the hop), or from one process's
write to the next one's read (the bytes on loopback and the wake-up of the process that reads them); "the load
generator" is the client's own turn between a reply and its next request. The event loop's turns per request
(its `epoll_pwait` calls) of each Python process follow. `perf trace` costs each system call some microseconds,
so the traced path is longer than the untraced p50 printed first (the load generator's, with the CPU each
request cost each process): read the rows against each other. Needs `perf` and the right to trace the
processes (root, or kernel.perf_event_paranoid at 1 or below).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import peers
from bench.compare import ensemble_variant
from bench.running import Pipeline, per_request, wait_ready

#: The stages a refcnn request visits, in order, between the router's turns.
STAGES = ("preprocess", "model", "postprocess")
#: The system calls recorded: what moves a request's bytes, and the event loops' waits.
SYSCALLS = "read,readv,write,writev,recvmsg,sendmsg,recvfrom,sendto,epoll_pwait,epoll_wait"
_READS = frozenset({"read", "readv", "recvmsg", "recvfrom"})
_WRITES = frozenset({"write", "writev", "sendmsg", "sendto"})
#: Reads and writes of fewer bytes are not a request's (an event loop's wake-up, a thread's eventfd).
MIN_BYTES = 64
#: One line of `perf trace`: start (ms), duration, thread name and id, the call (or its continuation), result.
_LINE = re.compile(
    r"^\s*(?P<start>[\d.]+) \(\s*(?P<took>[\d.]+)?\s*(?:ms)?\): \S+/(?P<tid>\d+)\s+"
    r"(?:\.\.\. \[continued\]: )?(?P<call>\w+)\(.*\)\s+= (?P<result>-?\d+)"
)


@dataclass(frozen=True, slots=True)
class Event:
    """A read or write of a request's bytes by one process (`kind`), in ms on `perf trace`'s clock: a read
    when it returned, a write when it began."""

    at: float
    kind: str
    direction: str  # "in" or "out"


def parse(lines: Iterable[str], kinds: Mapping[int, str], loop_threads: Mapping[int, str]) -> Iterator[Event]:
    """The reads and writes of a `perf trace` output, by the process kind of each thread id (`kinds`); of the
    Python processes only their event loop's thread (`loop_threads`: its id, the process's), whose frame
    connections carry the requests (their gRPC threads carry health checks and metadata)."""
    for line in lines:
        found = _LINE.match(line)
        if found is None or int(found["result"]) < MIN_BYTES:
            continue
        tid, call = int(found["tid"]), found["call"]
        kind = kinds.get(tid)
        if kind is None or (kind in loop_threads.values() and loop_threads.get(tid) != kind):
            continue
        start, took = float(found["start"]), float(found["took"] or 0.0)
        if call in _READS:
            yield Event(start + took, kind, "in")
        elif call in _WRITES:
            yield Event(start, kind, "out")


def path_of(stages: Sequence[str]) -> list[tuple[str, str]]:
    """The reads and writes a lone request's bytes go through, in order."""
    path = [("front", "in"), ("front", "out"), ("router", "in"), ("router", "out")]
    for stage in stages:
        path += [(stage, "in"), (stage, "out"), ("router", "in"), ("router", "out")]
    return [*path, ("front", "in"), ("front", "out")]


def requests(events: Iterable[Event], stages: Sequence[str]) -> list[list[float]]:
    """Each traced request's times along `path_of(stages)` (complete ones only), and the start of the next
    request as the last time. A process's further reads and writes within one of its hops are not counted
    (a frame read in two pieces); a read of the client's request by the front starts a request afresh."""
    path = path_of(stages)
    found: list[list[float]] = []
    times: list[float] = []
    for event in sorted(events, key=lambda e: e.at):
        step = (event.kind, event.direction)
        if step == path[0] and (not times or len(times) == len(path)):
            if len(times) == len(path):
                found.append([*times, event.at])
            times = [event.at]
        elif times and len(times) < len(path) and step == path[len(times)]:
            times.append(event.at)
    return found


def segments(stages: Sequence[str]) -> list[str]:
    """What each interval between two consecutive times of `requests` is."""
    names = ["front: the client's request to the router", "front -> router (loopback, wake-up)"]
    before = "the request"
    for stage in stages:
        names += [
            f"router: {before} -> {stage}",
            f"router -> {stage} (loopback, wake-up)",
            f"{stage}: its call",
            f"{stage} -> router (loopback, wake-up)",
        ]
        before = f"{stage}'s answer"
    names += [
        f"router: {before} -> the reply",
        "router -> front (loopback, wake-up)",
        "front: the router's reply to the client",
        "the load generator: the reply -> its next request",
    ]
    return names


def summary(found: list[list[float]], stages: Sequence[str], turns: Mapping[str, int]) -> str:
    """The table of each interval's median and spread (µs), the server's whole path, and the loop turns."""
    lines = [f"{len(found)} requests traced", "| hop | median µs | p10 | p90 |", "|---|---:|---:|---:|"]
    for i, name in enumerate(segments(stages)):
        lines.append(_row(name, [(times[i + 1] - times[i]) * 1e3 for times in found]))
    lines.append(_row("the server, front to front", [(times[-2] - times[0]) * 1e3 for times in found]))
    if found:
        each = ", ".join(f"{kind} {count / len(found):.1f}" for kind, count in turns.items())
        lines.append(f"event-loop waits (epoll_pwait) per request: {each}")
    return "\n".join(lines)


def _row(name: str, values: list[float]) -> str:
    if not values:
        return f"| {name} | - | - | - |"
    ranked = sorted(values)
    tenth, ninetieth = ranked[len(ranked) // 10], ranked[len(ranked) * 9 // 10]
    return f"| {name} | {statistics.median(ranked):.0f} | {tenth:.0f} | {ninetieth:.0f} |"


def loop_turns(lines: Iterable[str], loop_threads: Mapping[int, str]) -> dict[str, int]:
    """How many times each Python process's event loop waited for events (`epoll_pwait` calls)."""
    counted = dict.fromkeys(loop_threads.values(), 0)
    for line in lines:
        found = _LINE.match(line)
        if found is not None and found["call"] == "epoll_pwait":
            kind = loop_threads.get(int(found["tid"]))
            if kind is not None:
                counted[kind] += 1
    return counted


def threads(pids: Mapping[str, int]) -> dict[int, str]:
    """Every thread id of the processes, by their kind."""
    return {int(tid): kind for kind, pid in pids.items() for tid in os.listdir(f"/proc/{pid}/task")}


def trace(pids: Mapping[str, int], seconds: float, out: Path) -> list[str]:
    """`perf trace` of the processes' reads, writes and event-loop waits for `seconds`: its lines."""
    command = ["perf", "trace", "-p", ",".join(map(str, pids.values())), "-e", SYSCALLS, "-o", str(out)]
    subprocess.run(
        [*command, "--", "sleep", str(seconds)], check=True, capture_output=True, timeout=seconds + 60
    )
    return out.read_text(errors="replace").splitlines()


def measure(running: Pipeline, args: argparse.Namespace, work: Path) -> str:
    """The untraced p50 at one in flight with the CPU per request, then the traced hops."""
    oip = ("--model", "refcnn", "--input-name", "IMAGE", "--output-name", "LABEL")
    level = (args.warmup, args.duration, 1, *oip)
    before = running.cpu()
    row = peers.loadgen(args.peers, "v2grpc", running.router, "c=1", work / "c1.json", *level, quiet_wait=0)
    cpu = per_request(before, running.cpu(), row["throughput"] * (args.warmup + args.duration))
    head = f"untraced: p50 {row['p50_ms']:.2f} ms, {row['throughput']:.0f} requests/s; CPU µs per request "
    head += ", ".join(f"{kind} {value:.0f}" for kind, value in cpu.items())
    traced = (args.warmup, args.trace_seconds + 2 * args.warmup, 1, *oip)
    loading = threading.Thread(
        target=peers.loadgen,
        args=(args.peers, "v2grpc", running.router, "c=1 traced", work / "traced.json", *traced),
        kwargs={"quiet_wait": 0},
    )
    loading.start()
    try:
        threading.Event().wait(2 * args.warmup)  # the load generator's warm-up, and then some
        kinds = threads(running.pids)
        loops = {pid: kind for kind, pid in running.pids.items() if kind != "front"}
        lines = trace(running.pids, args.trace_seconds, work / "trace.txt")
    finally:
        loading.join()
    found = requests(parse(lines, kinds, loops), STAGES)
    return head + "\n\n" + summary(found, STAGES, loop_turns(lines, loops))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=Path, required=True, help="shared/peers laid out and set up there")
    parser.add_argument("--trace-seconds", type=float, default=3.0, help="seconds of perf trace")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each measured interval")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of the untraced run")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hops-") as folder:
        work = Path(folder)
        repository = ensemble_variant(work / "repository", True)
        running = Pipeline(repository, work / "pipeline.log", env={"PIPELINE_FRONT": "compiled"})
        try:
            asyncio.run(wait_ready(running.router, "refcnn"))
            print(measure(running, args, work), flush=True)
        finally:
            running.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

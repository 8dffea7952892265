"""bench.hops reads a `perf trace` of the pipeline's processes back as each lone request's path: a process's
read of the request's bytes and its write of them onward, hop after hop, with the other system calls left out."""

from __future__ import annotations

import itertools

from bench.hops import STAGES, loop_turns, parse, path_of, requests, segments, summary

#: Thread ids: the front's two threads, and each Python process's event loop (its pid) and one gRPC thread.
KINDS = {
    10: "front",
    11: "front",
    20: "router",
    21: "router",
    30: "preprocess",
    40: "model",
    50: "postprocess",
}
LOOPS = {20: "router", 30: "preprocess", 40: "model", 50: "postprocess"}


def line(at: float, tid: int, call: str, result: int, took: float = 0.02) -> str:
    return f"{at:10.3f} ({took:6.3f} ms): python/{tid} {call}(fd: 5, count: 65536)        = {result}"


def one_request(start: float) -> list[str]:
    """A lone request's reads and writes, 0.1 ms apart (reads take 0.02 ms: the time is when they return)."""
    hops = [(11, "recvmsg"), (10, "sendmsg"), (20, "read"), (20, "writev")]
    for tid in (30, 40, 50):
        hops += [(tid, "read"), (tid, "writev"), (20, "read"), (20, "writev")]
    hops += [(10, "recvfrom"), (10, "sendmsg")]
    return [line(start + 0.1 * i, tid, call, 1000) for i, (tid, call) in enumerate(hops)]


def test_a_traced_request_is_read_back_hop_by_hop():
    noise = [
        line(0.05, 20, "epoll_pwait", 1),
        line(0.15, 21, "recvmsg", 500),  # the router's gRPC thread: a health check, not the request
        line(0.25, 11, "write", 8),  # a thread's eventfd
        line(0.45, 30, "read", 2000),  # the rest of a frame read in two pieces: not a hop of its own
    ]
    lines = sorted(one_request(0.0) + one_request(5.0) + noise, key=lambda text: float(text.split()[0]))
    found = requests(parse(lines, KINDS, LOOPS), STAGES)
    assert len(found) == 1  # the second request has no next one to end its last interval
    times = found[0]
    assert len(times) == len(path_of(STAGES)) + 1 == len(segments(STAGES)) + 1
    # Reads count when they return, writes when they begin: a process's work 0.08 ms here, a crossing 0.12.
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(times)]
    assert gaps[:4] == [0.08, 0.12, 0.08, 0.12]
    assert times[-1] == 5.02  # the next request's read by the front
    table = summary(found, STAGES, loop_turns(lines, LOOPS))
    assert "| router -> model (loopback, wake-up) | 120 |" in table
    assert "| model: its call | 80 |" in table
    assert "router 1.0" in table  # one epoll_pwait of the router's loop

"""The services' allocator keeps buffers of a batch's size on the heap (no mapping of their own, so no page
faults each time), unless the environment says otherwise; checked with glibc's own count of mappings."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys

import pytest

#: Allocates a 1 MiB buffer after keep_freed_memory() and prints the change in glibc's mapped blocks.
_PROBE = """
import ctypes, ctypes.util
from pipeline.runtime.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory()
before = libc.mallinfo2().hblks
buffer = ctypes.create_string_buffer(1 << 20)
print(applied, libc.mallinfo2().hblks - before)
"""


def _probe(**malloc: str) -> tuple[str, int]:
    """Run the probe with glibc's MALLOC_* variables as given (and no others)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**env, **malloc}, capture_output=True, text=True, check=True
    )
    applied, mapped = out.stdout.split()
    return applied, int(mapped)


def _glibc() -> bool:
    name = ctypes.util.find_library("c")
    return name is not None and hasattr(ctypes.CDLL(name), "mallinfo2")


@pytest.mark.skipif(not _glibc(), reason="the allocator settings are glibc's (mallinfo2 counts its mappings)")
def test_a_megabyte_buffer_comes_from_the_heap() -> None:
    assert _probe() == ("True", 0)


@pytest.mark.skipif(not _glibc(), reason="the allocator settings are glibc's (mallinfo2 counts its mappings)")
def test_the_environment_wins() -> None:
    # glibc's own variable asks for a mapping of every buffer of 64 KiB and more: it is left as it is.
    assert _probe(MALLOC_MMAP_THRESHOLD_="65536") == ("True", 1)


#: Holds 100 MiB in buffers of 4 MiB (kept on the heap once freed), frees them, then lets an idle server's
#: give-back run, printing the resident MiB at rest, after the free, and after the give-back. With "thread",
#: the buffers come and go on another thread, as a request's bytes do on gRPC's own threads.
_BURST = """
import asyncio, sys
from pipeline.runtime.allocator import give_back_when_idle, keep_freed_memory, resident_bytes

keep_freed_memory()

def burst():
    buffers = [bytearray(4 << 20) for _ in range(25)]
    del buffers

async def burst_then_idle():
    rest, held = resident_bytes(), []
    trimming = asyncio.create_task(give_back_when_idle(held, interval=0.01, slack=8 << 20))
    await asyncio.sleep(0)  # it has read the size at rest
    held.append("a request")  # the server is busy while the burst comes and goes
    if sys.argv[1] == "thread":
        await asyncio.to_thread(burst)
    else:
        burst()
    kept = resident_bytes()
    held.clear()
    for _ in range(500):
        await asyncio.sleep(0.01)
        if resident_bytes() < rest + (16 << 20):
            break
    trimming.cancel()
    print(rest >> 20, kept >> 20, resident_bytes() >> 20)

asyncio.run(burst_then_idle())
"""


@pytest.mark.skipif(not _glibc(), reason="malloc_trim is glibc's")
@pytest.mark.parametrize("where", ["main", "thread"])
def test_an_idle_server_gives_back_what_a_burst_left_with_its_allocator(where: str) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _BURST, where], env=env, capture_output=True, text=True, check=True
    )
    rest, kept, after = map(int, out.stdout.split())
    assert kept >= rest + 64, (rest, kept, after)  # the freed burst stayed with the allocator
    assert after < rest + 16, (rest, kept, after)  # and went back once idle

"""The C allocator's settings for a serving process: keep freed memory for the next message.

Every batch that crosses a service allocates and frees buffers of hundreds of kilobytes (a batch of images,
its serialised request, the response). With glibc's defaults, many of those buffers are mapped from the
kernel and unmapped again, and the top of the heap is given back as soon as a large buffer is freed, so the
next batch pays for page faults and zeroed pages all over again: at batches of 12 refcnn images, a
preprocess stage spent three times its normalising CPU on that. Here buffers up to `MMAP_THRESHOLD` come
from the heap and freed memory up to `TRIM_THRESHOLD` stays there for reuse.

Only glibc's `mallopt` is called; on other C libraries (musl, macOS) nothing changes. `MALLOC_*_` variables
set in the environment win over these settings, as glibc's documentation says they should.

What is kept for the next message is given back once the server is idle (`give_back_when_idle`): a burst of
large requests, refused or served, would otherwise leave the process up to `TRIM_THRESHOLD` larger for good.
For that, every thread allocates from one arena (`ARENAS`). By default glibc gives each new thread an arena of
its own (up to eight per core), and `malloc_trim` cannot shrink those below their top: a large request read
on gRPC's own threads left up to 64 MiB in each of their arenas for good (a router took twenty refused 40 MB
loads from 92 MB to 157-274 MB once idle; with one arena it comes back to 92-118). A serving process's work runs
on one thread (its event loop), so the arenas' locks are rarely contended.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Sized

log = logging.getLogger(__name__)

#: glibc's `mallopt` parameters (malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8

#: Buffers smaller than this come from the heap, not from a mapping of their own.
MMAP_THRESHOLD = 16 << 20
#: Free memory at the top of the heap kept for reuse, not given back to the kernel.
TRIM_THRESHOLD = 128 << 20
#: What the heap grows by beyond a request, so that growing it is rare.
TOP_PAD = 16 << 20
#: Arenas every thread allocates from: one, which an idle server's give-back trims all the way.
ARENAS = 1

#: How often an idle server looks at what its allocator keeps, in seconds.
IDLE_CHECK_S = 5.0
#: What the process may hold above its size after the last give-back before an idle server gives memory back.
IDLE_SLACK = 32 << 20

_SETTINGS = (
    ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    ("MALLOC_TOP_PAD_", M_TOP_PAD, TOP_PAD),
    ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    ("MALLOC_ARENA_MAX", M_ARENA_MAX, ARENAS),
)


def _libc_function(name: str):
    """A function of glibc, or None (another C library)."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        return getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Apply the settings above to this process's allocator; whether glibc took them. A server's entry point
    calls it first, before its imports start threads: a thread keeps the arena it was given, and glibc hands
    arenas made before this call to threads made after it."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False  # not glibc
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = True
    for variable, parameter, value in _SETTINGS:
        if variable not in os.environ:
            applied = mallopt(parameter, value) == 1 and applied
    if not applied:
        log.debug("the C allocator refused some of its settings")
    return applied


def give_back() -> bool:
    """Return the free memory the allocator keeps to the kernel (glibc's `malloc_trim`); whether it could."""
    malloc_trim = _libc_function("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    malloc_trim(0)
    return True


def resident_bytes() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def give_back_when_idle(held: Sized, interval: float = IDLE_CHECK_S, slack: int = IDLE_SLACK) -> None:
    """Until cancelled: where the server held no request at two checks in a row (`held`: its requests being
    served), and the process is `slack` bytes larger than after the last give-back, give the allocator's free
    memory back."""
    if not os.path.exists("/proc/self/statm"):
        return  # not Linux: nothing to read the size from
    size, idle = resident_bytes(), False
    while True:
        await asyncio.sleep(interval)
        was_idle, idle = idle, not len(held)
        if was_idle and idle and resident_bytes() > size + slack:
            if not await asyncio.to_thread(give_back):
                return
            size = resident_bytes()
            log.debug("gave free memory back to the system: %d MiB resident", size >> 20)

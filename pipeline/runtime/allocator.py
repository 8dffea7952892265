"""The C allocator's settings for a serving process: keep freed memory for the next message.

Every batch that crosses a service allocates and frees buffers of hundreds of kilobytes (a batch of images,
its serialised request, the response). With glibc's defaults, many of those buffers are mapped from the
kernel and unmapped again, and the top of the heap is given back as soon as a large buffer is freed, so the
next batch pays for page faults and zeroed pages all over again: at batches of 12 refcnn images, a
preprocess stage spent three times its normalising CPU on that. Here buffers up to `MMAP_THRESHOLD` come
from the heap and freed memory up to `TRIM_THRESHOLD` stays there for reuse.

Only glibc's `mallopt` is called; on other C libraries (musl, macOS) nothing changes. `MALLOC_*_` variables
set in the environment win over these settings, as glibc's documentation says they should.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

#: glibc's `mallopt` parameters (malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3

#: Buffers smaller than this come from the heap, not from a mapping of their own.
MMAP_THRESHOLD = 16 << 20
#: Free memory at the top of the heap kept for reuse, not given back to the kernel.
TRIM_THRESHOLD = 128 << 20
#: What the heap grows by beyond a request, so that growing it is rare.
TOP_PAD = 16 << 20

_SETTINGS = (
    ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    ("MALLOC_TOP_PAD_", M_TOP_PAD, TOP_PAD),
    ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
)


def keep_freed_memory() -> bool:
    """Apply the settings above to this process's allocator; whether glibc took them."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = True
    for variable, parameter, value in _SETTINGS:
        if variable not in os.environ:
            applied = mallopt(parameter, value) == 1 and applied
    if not applied:
        log.debug("the C allocator refused some of its settings")
    return applied

"""glibc's malloc arenas, capped for the whole process before the service starts its threads.

glibc gives each new thread an arena of its own, up to eight per core, and an arena keeps the high-water mark
of what its thread allocated. The service's threads (the codec thread pool, the staging threads, the GPU
workers) each decode, encode and stage operands of up to megabytes, so resident memory grew by the peak of
every thread: 80 MiB over 2.5 minutes of `scripts/soak.py` on a 2-core machine with the CPU backend, still
rising at the end, against 20 MiB and flat within a minute with two arenas. Arrays large enough to be mapped
on their own (`mmap`) are not affected by the cap.
"""

from __future__ import annotations

import ctypes
import os
import platform

ARENA_ENV = "MALLOC_ARENA_MAX"
"""glibc's own variable: when the operator sets it, glibc has applied it and the service leaves it alone."""
DEFAULT_ARENAS = 2
M_ARENA_MAX = -8
"""mallopt's parameter number for the arena cap, from glibc's malloc.h."""


def cap_malloc_arenas(arenas: int = DEFAULT_ARENAS) -> bool:
    """Cap the process's malloc arenas at `arenas` unless MALLOC_ARENA_MAX is set or the C library is not glibc.

    Threads that already have an arena keep it, so call this before starting threads. Returns whether the cap
    was applied."""
    if ARENA_ENV in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(arenas)))

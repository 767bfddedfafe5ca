"""Keep a serving process's native heap from creeping up as sessions come and go (glibc only).

Measured with `python -m bench.soak` (docs/BENCHMARKS.md): the Python heap and the live tensors of a
server stay flat across sessions, but its RSS kept growing. Each gRPC thread that drives engine steps got
a malloc arena of its own, and the step temporaries between glibc's dynamic mmap threshold and a few MiB
(activations and gathered keys of prompts of every length) fragmented them. `bound()` caps the arenas
and pins the mmap threshold, so those temporaries are mapped and unmapped whole; `trim()` hands freed
heap tops back to the system (the decode worker calls it with its heartbeat). Elsewhere than glibc both
do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3       # mallopt parameters (glibc malloc.h)
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 64 * 1024
ARENA_MAX = 2


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def bound() -> bool:
    """Cap malloc arenas and pin the mmap threshold for allocations made from now on; call it before the
    model loads and the servers' threads start. True when glibc took both settings."""
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_ARENA_MAX, ARENA_MAX)) and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not ok:
        log.warning("glibc refused the malloc settings: the native heap may grow with the sessions served")
    return ok


def trim() -> None:
    """Return freed memory at the heaps' tops to the system."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)

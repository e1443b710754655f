"""Host memory the C allocator holds: handed back to the OS when a bundle leaves.

Freeing a tensor on the CPU calls free(), and glibc's malloc keeps what it is
given back unless told otherwise, so `/models` said 0 bytes reserved while
the process kept every byte it ever loaded (RSS with nothing loaded grew past
twice the idle baseline over a few load/unload cycles of SmolLM2). Three
reasons, each with its control here:

- The mmap threshold climbs. An allocation above it gets a mapping of its own,
  unmapped on free; below it, the heap. glibc raises the threshold to the size
  of each mapped block freed (up to 32 MiB), so after the first unload the
  next bundle's tensors land on the heap, where freed memory stays.
  `configure` fixes the threshold (M_MMAP_THRESHOLD, which also stops the
  climbing): weight tensors and large activations are mapped and unmapped.
- Every thread that allocates gets an arena of its own (up to 8 per core),
  and each keeps its freed memory: loads, builders and up to 64 handler
  threads each filled one. `configure` caps them (M_ARENA_MAX).
- Freed memory inside a heap (below its top) is never returned by free().
  `trim` (malloc_trim(0): every arena, every whole free page) runs once a
  bundle's tensors are freed, on unload and eviction (framework.release).

Off glibc (musl, macOS) these are no-ops: `supported()` says so and the
settings are ignored. Nothing here imports torch; ctypes is loaded lazily.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.settings import Settings

log = logging.getLogger("thaw.memory")

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@dataclass
class _Control:
    # On until configured otherwise: an unload returns memory wherever the cache runs.
    trim: bool = True


_control = _Control()


@functools.cache
def libc() -> Any | None:
    """glibc through ctypes, or None elsewhere (its foreign calls release the GIL).

    Made once: making it is a dlopen, which waits while another thread's dlopen
    runs its libraries' initialisers, holding the GIL meanwhile."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError, AttributeError):
        return None
    import ctypes

    try:
        found = ctypes.CDLL(None)
        found.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        found.mallopt.restype = ctypes.c_int
        found.malloc_trim.argtypes = [ctypes.c_size_t]
        found.malloc_trim.restype = ctypes.c_int
        found.dlopen.restype = ctypes.c_void_p
        found.dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return found


def supported() -> bool:
    """Whether this process's C allocator is glibc's, which these controls drive."""
    return libc() is not None


def configure(settings: Settings) -> None:
    """Set the allocator up for a process that loads and frees whole models.

    Called by the entry points (`thaw serve`, the Lambda loop) once the settings
    are read, before the threads that load and serve exist (an arena cap binds
    the arenas made after it). A control set to 0 is left to glibc (and its
    MALLOC_* variables).
    """
    _control.trim = settings.malloc_trim
    glibc = libc()
    if glibc is None:
        return
    threshold, arenas = settings.mmap_threshold_bytes, settings.malloc_arena_max
    if threshold and not glibc.mallopt(_M_MMAP_THRESHOLD, threshold):
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) was refused", threshold)
    if arenas and not glibc.mallopt(_M_ARENA_MAX, arenas):
        log.warning("mallopt(M_ARENA_MAX, %d) was refused", arenas)


def trim() -> None:
    """Return every whole free page the allocator holds to the OS (when configured)."""
    if _control.trim:
        glibc = libc()
        if glibc is not None:
            glibc.malloc_trim(0)

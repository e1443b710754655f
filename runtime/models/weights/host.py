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
  climbing), low in a bundle's window (THAW_MMAP_THRESHOLD_BYTES, 1 MiB):
  its weight tensors are mapped, and unmapped when freed.
- A low threshold costs the request path, though: every allocation above it
  is a fresh mapping, its pages faulted in on each call (about 4 us a page in
  a VM), and orjson's scratch for a JSON body of 400 KB is two of 4-5 MB: a
  warm echo of one faulted in 550 pages, half of its CPU. And fixing the
  threshold fixed the trim threshold at glibc's 128 KiB (the two climb
  together otherwise), so the heap's top went back to the OS whenever 128 KiB
  of it was free, and a 60 KB body's allocations were faulted in afresh every
  time. So the low mmap threshold holds only while a bundle's memory is made
  or given back (`bundle_window`: its load, build and warm-up; its unload or
  eviction), and the low trim threshold only while it is given back; the rest
  of the time both are 32 MiB (glibc's ceiling for its own climbing
  threshold), and requests reuse the heap. With the trim threshold left at
  64 MiB through unloads too, SmolLM2's idle RSS after an unload sometimes
  stayed 30 MiB higher (tests/pretrained/test_host_memory.py, once in four
  runs): a window that gives memory back has glibc's 128 KiB. One that makes
  it does not: a builder's heap top went back to the OS, and was faulted in
  again, on every free of 128 KiB there (1,650 brk calls in SmolLM2's build
  against glibc's own 830; with its builder's staging buffer too,
  handlers/models/llama.py, the build went from 360 to 330 ms: BENCHMARKS.md,
  issue 29).
  `malloc_trim` never shrinks the top of a thread's own arena, so what a
  handler thread's requests freed there stays for its next request (BENCHMARKS.md,
  "Large payloads on the warm path").
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
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from runtime.settings import Settings

log = logging.getLogger("thaw.memory")

T = TypeVar("T")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# Outside a bundle's window both thresholds are glibc's ceiling for its own
# climbing mmap threshold on 64-bit; inside it, the trim threshold is glibc's
# default (see above).
SERVING_THRESHOLD = 32 * 1024 * 1024
WINDOW_TRIM_THRESHOLD = 128 * 1024


@dataclass
class _Control:
    # On until configured otherwise: an unload returns memory wherever the cache runs.
    trim: bool = True
    # THAW_MMAP_THRESHOLD_BYTES in a bundle's window (0: glibc's own, nothing switched).
    load_threshold: int = 0
    windows: int = 0
    # Of those, the windows in which a bundle's memory is given back.
    returning: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


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
    if threshold:
        with _control.lock:
            _control.load_threshold = threshold
            _apply(glibc)
    if arenas:
        _mallopt(glibc, _M_ARENA_MAX, arenas)


@contextmanager
def bundle_window(*, returning: bool = False) -> Iterator[None]:
    """The window in which a bundle's memory is made (its fetch, load, build and
    warm-up) or, `returning`, given back (its unload or eviction, a failed load's
    release, the trim included): while any is open, allocations from
    THAW_MMAP_THRESHOLD_BYTES up are mappings of their own; while one that
    returns is open, a free past 128 KiB at a heap's top returns it too. Windows
    may overlap, from any thread."""
    _switch(+1, returning)
    try:
        yield
    finally:
        _switch(-1, returning)


def within_window(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a window of its own, for a thread that makes a bundle's memory.

    The load's window closes when the load ends, but a thread it started cannot be
    stopped: a phase that stalled or was abandoned (an unload mid-read) leaves its
    thread reading weights or building. Holding a window itself, it goes on making
    that memory as the load did, mapped and returned when freed, until it ends."""
    with bundle_window():
        return fn(*args)


def windows_open() -> int:
    """How many bundle windows are open now (loads, unloads, their threads)."""
    return _control.windows


def _switch(step: int, returning: bool) -> None:
    with _control.lock:
        before = _thresholds()
        _control.windows += step
        _control.returning += step if returning else 0
        # A load threshold is set only by `configure`, which made `libc()` already.
        if _thresholds() != before and _control.load_threshold:
            glibc = libc()
            if glibc is not None:
                _apply(glibc)


def _thresholds() -> tuple[int, int]:
    """The mmap and trim thresholds the open windows call for."""
    mmap = _control.load_threshold if _control.windows else SERVING_THRESHOLD
    trim = WINDOW_TRIM_THRESHOLD if _control.returning else SERVING_THRESHOLD
    return mmap, trim


def _apply(glibc: Any) -> None:
    mmap, trim = _thresholds()
    _mallopt(glibc, _M_MMAP_THRESHOLD, mmap)
    _mallopt(glibc, _M_TRIM_THRESHOLD, trim)


_NAMES = {_M_TRIM_THRESHOLD: "M_TRIM_THRESHOLD", _M_MMAP_THRESHOLD: "M_MMAP_THRESHOLD"}


def _mallopt(glibc: Any, option: int, value: int) -> None:
    if not glibc.mallopt(option, value):
        log.warning("mallopt(%s, %d) was refused", _NAMES.get(option, "M_ARENA_MAX"), value)


def trim() -> None:
    """Return every whole free page the allocator holds to the OS (when configured)."""
    if _control.trim:
        glibc = libc()
        if glibc is not None:
            glibc.malloc_trim(0)

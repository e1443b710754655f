"""Pages: anonymous memory mapped for writing in one call, and files read past the
page cache (O_DIRECT), for the landing (landing.py).

Through ctypes where Python's own binding would hold the GIL for the length of a
call that populates gigabytes.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from collections.abc import Callable
from pathlib import Path

# O_DIRECT's unit: a direct read starts and ends on a multiple of it, into memory
# aligned to it (4096 covers every logical block size Linux disks report).
BLOCK = 4096
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


@functools.cache
def madvise_fn() -> Callable[[int, int, int], int] | None:
    """libc's madvise through ctypes, which releases the GIL (mmap.madvise holds it:
    populating 6 GiB under it serialised the readers and stalled the import)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def address(buffer: mmap.mmap | memoryview) -> int:
    """The address of `buffer`'s first byte."""
    view = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def prefault(buffer: mmap.mmap | memoryview, start: int, nbytes: int) -> None:
    """Map the range for writing in one call (as cpu.py's `_prefault`: a fault per page costs
    more than the copy). Best effort: older kernels refuse it. A view's range is
    widened to whole pages of the mapping it views."""
    madvise = madvise_fn()
    if madvise is None or nbytes <= 0:
        return
    at = address(buffer) + start
    begin = at - at % mmap.PAGESIZE
    madvise(begin, at + min(nbytes, len(buffer) - start) - begin, _MADV_POPULATE_WRITE)


def cached(fd: int, size: int) -> bool:
    """Whether the file looks to be in the page cache already (a warm node): a byte
    at a quarter, half and three quarters of it can be read without waiting for the
    disk. Then a buffered read copies it from memory, faster than the disk again."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None:
        return True
    probe = bytearray(1)
    try:
        return all(os.preadv(fd, [probe], size * q // 4, nowait) == 1 for q in (1, 2, 3))
    except OSError:  # BlockingIOError: not cached; anything else: read as before
        return False


def open_direct(path: Path, opened: os.stat_result) -> int:
    """`path` opened again with O_DIRECT, if the filesystem allows it and it is the file
    `opened` describes; else -1 (read through the page cache)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | flag)
    except OSError:
        return -1
    again = os.fstat(fd)
    if (again.st_dev, again.st_ino, again.st_size) != (
        opened.st_dev,
        opened.st_ino,
        opened.st_size,
    ):
        os.close(fd)
        return -1
    return fd


def meminfo(field: str) -> int:
    """A /proc/meminfo figure in bytes, e.g. "MemTotal" (0 where unknown)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                if name == field:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def available_bytes() -> int:
    """The memory available to start new work without swapping (0 where unknown)."""
    return meminfo("MemAvailable")

"""Shards on a read-only filesystem: mapped for the build, copied out only where kept.

On the CPU a load copies every byte of its shards into memory the process owns
(cpu.py), so that no rewrite or truncation of a bundle's files can reach a
model or kill the process. On a filesystem nobody can write (a Lambda
function's image, a container with a read-only root or volume) neither can
happen, and the copy buys nothing where the builder repacks the weights
anyway: SmolLM2's builder converts and packs every matrix, so the load's copy
of its 269 MB was thrown away, 65 ms of a fresh node's 1.5 s first answer
(BENCHMARKS.md, issue 29's twelfth session).

So there a shard is mapped (private and writable: a builder that edits a weight
in place gets its own copy of the page), and each tensor views the mapping
through a buffer of its own, whose finalizer runs when the last tensor that
views it is freed. A tensor the builder consumes gives its pages back then, as
a consumed copy does, so a load's RSS peaks no higher than a copying one's.
Once the builder has returned, `Region.detach` copies the pages of the tensors
still alive into anonymous memory and moves that memory over the same
addresses (mremap): the model's tensors keep their pointers and no longer view
the file. Every other page becomes an inaccessible reservation. After it
nothing of the file is mapped, as on the copy path, and the whole range is
unmapped when the last tensor viewing it is freed.

Read-only means that nothing can write the file (`immutable`): a filesystem
read-only for every mount of it, or a container image's overlay mounted
read-only. A read-only bind mount of a writable filesystem can still be written
through another mount, so its shards take the copy path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import platform
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.bundles import chunks
from runtime.bundles.sources import pages
from runtime.errors import BundleError
from runtime.models.weights.cpu import _prefault

if TYPE_CHECKING:
    import torch

    from runtime.bundles.chunks import Chunked
    from runtime.models.weights.cpu import Shard
    from runtime.models.weights.format import TensorSpec

PAGE = mmap.PAGESIZE
# The kernel's values on the architectures where they are these; Python's mmap
# module does not export PROT_NONE, MAP_FIXED, MAP_NORESERVE or mremap's flags.
_ARCHES = frozenset({"x86_64", "aarch64"})
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MADV_POPULATE_READ = 22  # Linux 5.14+; refused before, harmlessly
_FAILED = ctypes.c_void_p(-1).value
# One copy task of `detach`: spread over two threads, as the copy path's reads are.
COPY_CHUNK = 16 * 1024 * 1024
MOUNTINFO = Path("/proc/self/mountinfo")


@dataclass(frozen=True)
class _Libc:
    mmap: Callable[..., int | None]
    munmap: Callable[[int, int], int]
    mremap: Callable[..., int | None]


@functools.cache
def _libc() -> _Libc | None:
    """libc's mapping calls, or None where this module's constants do not hold.
    Foreign calls release the GIL."""
    if sys.platform != "linux" or platform.machine() not in _ARCHES:
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        fns = lib.mmap, lib.munmap, lib.mremap
    except (OSError, AttributeError):
        return None
    vp, size, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    fns[0].argtypes = [vp, size, i, i, i, ctypes.c_long]
    fns[0].restype = vp
    fns[1].argtypes = [vp, size]
    fns[1].restype = i
    fns[2].argtypes = [vp, size, size, i, vp]
    fns[2].restype = vp
    return _Libc(*fns)


def supported() -> bool:
    return _libc() is not None


def immutable(fd: int) -> bool:
    """Whether nothing can write the open file `fd` while it is mapped.

    Its mount must be read-only (statvfs), and either its filesystem is
    read-only for every mount of it (its superblock's own options), or it is an
    overlay (a container's image) with no writable mount of it in this mount
    namespace: an overlay's layers may not change while it is mounted (the
    kernel's overlayfs documentation), so a read-only overlay is the image's own
    read-only root (`docker run --read-only`, which remounts only the mount). A
    read-only bind mount of a writable filesystem is neither: a host process can
    still rewrite or truncate its files through another mount.
    """
    if not os.fstatvfs(fd).f_flag & os.ST_RDONLY:
        return False
    dev = os.fstat(fd).st_dev
    key = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:
        return False
    mounts = []
    for line in lines:
        # ID PARENT MAJOR:MINOR ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER
        fields = line.split()
        if len(fields) < 10 or fields[2] != key or "-" not in fields[6:]:
            continue
        tail = fields[fields.index("-", 6) + 1 :]
        if len(tail) < 3:
            return False
        mounts.append((fields[5].split(","), tail[0], tail[2].split(",")))
    if any("ro" in sb for _opts, _kind, sb in mounts):
        return True
    return bool(mounts) and all(kind == "overlay" and "ro" in opts for opts, kind, _sb in mounts)


def _round_down(n: int) -> int:
    return n - n % PAGE


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class Region:
    """One shard mapped: the views handed out, and the changes to its pages, in order.

    Until it is unmapped its pages change in two ways: `detach` (once), and the
    finalizers of views freed before that, which run on whatever thread frees
    them. `lock` orders them; it is reentrant because a collection can run a
    finalizer on the detaching thread itself, which then leaves the pages to
    `detach`.
    """

    def __init__(self, shard: Shard) -> None:
        libc = _libc()
        assert libc is not None, "callers check supported()"
        self._libc = libc
        self.rel = shard.rel
        self.size = shard.opened.st_size
        address = libc.mmap(
            None, self.size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, shard.fd, 0
        )
        if address is None or address == _FAILED:
            raise OSError(ctypes.get_errno(), f"mmap: {os.strerror(ctypes.get_errno())}")
        self.address = address
        self.lock = threading.RLock()
        self.building = True
        # (first byte, end byte, its buffer's finalizer: alive while a tensor views it)
        self._views: list[tuple[int, int, weakref.finalize[[int, int], Any]]] = []
        # The callback holds no reference to this region: it is freed, and the
        # range unmapped, once no view's finalizer (which holds it) is pending.
        weakref.finalize(self, libc.munmap, address, self.size).atexit = False

    def view(self, spec: TensorSpec) -> torch.Tensor:
        """`spec`'s tensor, viewing the mapping (a copy of it where unaligned or empty)."""
        import torch

        start = self.address + spec.offset
        if spec.nbytes == 0 or start % spec.dtype.itemsize:
            tensor = torch.empty(spec.shape, dtype=spec.dtype)
            if spec.nbytes:
                ctypes.memmove(tensor.data_ptr(), start, spec.nbytes)
            return tensor
        buffer = (ctypes.c_char * spec.nbytes).from_address(start)
        tensor = torch.frombuffer(buffer, dtype=spec.dtype).view(spec.shape)
        freed = weakref.finalize(buffer, self._freed, spec.offset, spec.offset + spec.nbytes)
        freed.atexit = False
        self._views.append((spec.offset, spec.offset + spec.nbytes, freed))
        return tensor

    def _freed(self, start: int, end: int) -> None:
        """No tensor views [start, end) any more: its whole pages leave the file now."""
        first, last = _round_up(start), _round_down(end)
        if last <= first:
            return
        with self.lock:
            # After detach the range goes when its last view does. A refusal here
            # (no memory for the split) only leaves the pages mapped until detach.
            if self.building:
                with contextlib.suppress(BundleError):
                    self._reserve(first, last)

    def _reserve(self, start: int, end: int) -> None:
        """[start, end) of the range: inaccessible, no memory, no file behind it."""
        got = self._libc.mmap(
            self.address + start,
            end - start,
            _PROT_NONE,
            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE,
            -1,
            0,
        )
        if got is None or got == _FAILED:
            raise BundleError(f"{self.rel}: could not release its mapping ({_errno()})")

    def verify(self, entry: Chunked) -> None:
        """Check each chunk of the mapping against `entry`'s digests, in parallel."""

        def one(index: int) -> None:
            start, end = chunks.chunk_span(self.size, entry.chunk_bytes, index)
            view = memoryview((ctypes.c_char * (end - start)).from_address(self.address + start))
            chunks.check(entry, index, [view.cast("B")])

        count = len(entry.chunks)
        with ThreadPoolExecutor(max(1, min(count, chunks.threads()))) as pool:
            for future in [pool.submit(one, i) for i in range(count)]:
                future.result()

    def detach(self) -> int:
        """Copy out of the file the pages of the views still alive; reserve the rest.
        The bytes copied (whole pages)."""
        with self.lock:
            if not self.building:
                return 0
            self.building = False
            alive = [
                (_round_down(start), _round_up(end))
                for start, end, freed in self._views
                if freed.alive
            ]
            kept = _merged(alive)
            self._privatize(kept)
            gaps, at = [], 0
            for start, end in [*kept, (_round_up(self.size), _round_up(self.size))]:
                if start > at:
                    gaps.append((at, start))
                at = end
            for start, end in gaps:
                self._reserve(start, end)
            self._views = []
            return sum(end - start for start, end in kept)

    def _privatize(self, ranges: list[tuple[int, int]]) -> None:
        """Each range's pages copied into anonymous memory moved over them, a chunk at
        a time: a chunk's file pages leave as its copy arrives, so the copies never
        sit beside all of the pages they replace."""
        chunks = [
            (at, min(COPY_CHUNK, end - at))
            for start, end in ranges
            for at in range(start, end, COPY_CHUNK)
        ]
        if len(chunks) > 1:
            with ThreadPoolExecutor(2, thread_name_prefix="thaw-detach") as pool:
                list(pool.map(self._copy_out, chunks))
        else:
            for chunk in chunks:
                self._copy_out(chunk)

    def _copy_out(self, chunk: tuple[int, int]) -> None:
        libc = self._libc
        start, length = chunk
        rw, private = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        copy = libc.mmap(None, length, rw, private, -1, 0)
        if copy is None or copy == _FAILED:
            raise BundleError(f"{self.rel}: no memory to copy its weights into ({_errno()})")
        source = self.address + start
        # In-kernel population of both sides instead of a fault per page (cpu._prefault).
        madvise = pages.madvise_fn()
        if madvise is not None:
            madvise(source, length, _MADV_POPULATE_READ)
        _prefault(copy, length)
        ctypes.memmove(copy, source, length)
        moved = libc.mremap(copy, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, source)
        if moved is None or moved == _FAILED:
            libc.munmap(copy, length)
            raise BundleError(f"{self.rel}: could not move its weights ({_errno()})")


def _errno() -> str:
    return os.strerror(ctypes.get_errno())


def map_shard(
    shard: Shard, dtype: torch.dtype | None, check: Chunked | None = None
) -> tuple[dict[str, torch.Tensor], Region]:
    """Every tensor of `shard`, viewing its mapping; those converted to `dtype` are copies.
    With `check`, every chunk of the mapping is checked against its digest first, on
    every core: the pages it faults in are the ones the views then read."""
    region = Region(shard)
    if check is not None:
        region.verify(check)
    out: dict[str, torch.Tensor] = {}
    for spec in shard.tensors:
        tensor = region.view(spec)
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)  # the view is freed at once, and its pages with it
        out[spec.name] = tensor
    return out, region

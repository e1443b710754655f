"""The CPU read path: every byte of a bundle's shards copied into memory the process owns.

Nothing stays mapped: once a model is loaded no change to the bundle's files
(a rewrite, a truncation, another version copied over it) can reach its
answers or crash the process, and a shard that changes while it is read
fails the load.
"""

from __future__ import annotations

import functools
import os
import queue
import stat
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.bundles.stamps import Stamp, stamp_of
from runtime.errors import BundleError, IntegrityError
from runtime.models.weights.format import header_length, parse_header

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

# One read task: large enough that syscalls and thread hand-offs vanish in the
# copy, small enough that a big tensor spreads over every read thread.
CHUNK_BYTES = 16 * 1024 * 1024
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, or None off Linux. Foreign calls release the GIL."""
    if sys.platform != "linux":
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _prefault(address: int, nbytes: int) -> None:
    """Map fresh memory for writing in one call, before a read fills it.

    Filling memory the process never touched costs a page fault per page, and
    those faults, not the copy, are most of a copying load. One
    MADV_POPULATE_WRITE per read has the kernel map the range in a loop instead
    of a trap per page: first loads of 1 GiB in fresh processes took 0.38-0.98 s
    against 0.64-1.09 s without it on this machine (median 0.69 vs 0.87 s).
    Best effort: older kernels refuse it (EINVAL) and the read faults as before.
    """
    madvise = _madvise()
    if madvise is None or nbytes <= 0:
        return
    start = address - address % _PAGE_BYTES
    madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE)


class Shard:
    """One open shard file: what it held when opened, and the stat to hold it to."""

    def __init__(self, path: Path, rel: str, size: int, verified: Stamp | None = None) -> None:
        self.path = path
        self.rel = rel
        try:
            # O_NOFOLLOW and O_NONBLOCK: a shard swapped for a link or a FIFO since
            # it was verified is refused, never followed or waited on.
            self.fd = os.open(
                path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
            )
        except FileNotFoundError as exc:
            raise IntegrityError(f"{rel}: deleted since it was verified", file=rel) from exc
        except OSError as exc:
            raise BundleError(f"{rel}: cannot be opened ({exc.strerror})") from exc
        try:
            self.opened = os.fstat(self.fd)
            if not stat.S_ISREG(self.opened.st_mode):
                raise BundleError(f"{rel}: is not a regular file")
            if self.opened.st_size != size:
                raise IntegrityError(
                    f"{rel}: size {self.opened.st_size} does not match manifest size {size} "
                    "(changed since it was verified)",
                    file=rel,
                )
            if verified is not None and stamp_of(self.opened) != verified:
                # Same size, other bytes or another file: rewritten or replaced after
                # its hash matched (it is verified again on the next load).
                raise IntegrityError(f"{rel}: changed since it was verified", file=rel)
            prefix = os.pread(self.fd, 8, 0)
            header_len = header_length(prefix, size, rel)
            raw = os.pread(self.fd, header_len, 8)
            if len(raw) != header_len:
                raise self.changed()
            start = 8 + header_len
            self.tensors = parse_header(raw, size - start, start, rel)
        except BaseException:
            os.close(self.fd)
            raise

    def changed(self) -> IntegrityError:
        return IntegrityError(
            f"{self.rel}: changed while it was being read (it is verified again on the next load)",
            file=self.rel,
        )

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill `view` from the file at `offset`; a file that ended early has changed."""
        done = 0
        while done < len(view):
            try:
                n = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                raise BundleError(f"{self.rel}: read failed ({exc.strerror})") from exc
            if n == 0:
                raise self.changed()
            done += n

    def check_unchanged(self) -> None:
        """Refuse the bytes read if the file, or what its path names, changed since it was
        opened: a rewrite in place moves mtime and ctime, a rename or delete the path."""
        now = os.fstat(self.fd)
        try:
            named = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            raise self.changed() from None
        if not stamp_of(self.opened) == stamp_of(now) == stamp_of(named):
            raise self.changed()

    def close(self) -> None:
        os.close(self.fd)


def _writable(tensor: torch.Tensor) -> memoryview:
    """The bytes of a fresh, contiguous CPU tensor, writable in place (no copy).

    The view does not own the memory: callers keep `tensor` alive while using it.
    """
    import ctypes

    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def read_shards(
    shards: list[Shard],
    dtype: torch.dtype | None,
    chunk_bytes: int = CHUNK_BYTES,
    on_progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Copy every tensor of `shards` into fresh memory of this process, in parallel.

    The tensors never view a file: safetensors' `load_file` hands out tensors
    that view a MAP_PRIVATE mapping of the shard, so a READY model read the
    bundle's files on every request. Rewriting one changed its answers, and
    truncating one killed the process with SIGBUS (copy-on-write pages of a
    private mapping are unmapped past a truncated end too). Reading with
    pread() never maps the file: a shard cut short during the read is a short
    read, refused, not a signal.

    Each tensor gets its own allocation (a model that keeps a few tensors
    frees the rest), read in chunks of `chunk_bytes` spread over threads (pread and torch's
    copies release the GIL). A tensor converted to `dtype` is read a chunk at a
    time into a scratch buffer and converted from there, so the file's dtype
    never occupies memory in full. `on_progress(n)` is told each chunk's n bytes
    read, from the reading threads.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    # (shard, destination, first byte, end byte (of the destination's elements
    # for a conversion), source dtype when converting)
    tasks: list[tuple[Shard, torch.Tensor, int, int, int, torch.dtype | None]] = []
    for shard in shards:
        for spec in shard.tensors:
            if spec.name in out:
                raise BundleError(f"tensor {spec.name!r} appears in two shards")
            convert = dtype is not None and spec.dtype.is_floating_point and spec.dtype != dtype
            target = torch.empty(spec.shape, dtype=dtype if convert else spec.dtype)
            out[spec.name] = target
            step = max(1, chunk_bytes // spec.dtype.itemsize) * spec.dtype.itemsize
            for begin in range(0, spec.nbytes, step):
                end = min(spec.nbytes, begin + step)
                tasks.append(
                    (
                        shard,
                        target,
                        spec.offset + begin,
                        begin,
                        end,
                        spec.dtype if convert else None,
                    )
                )
    if not tasks:
        return out
    scratch: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()

    def run(task: tuple[Shard, torch.Tensor, int, int, int, torch.dtype | None]) -> None:
        read(task)
        if on_progress is not None:
            on_progress(task[4] - task[3])

    def read(task: tuple[Shard, torch.Tensor, int, int, int, torch.dtype | None]) -> None:
        shard, target, offset, begin, end, source = task
        if source is None:
            _prefault(target.data_ptr() + begin, end - begin)
            shard.read_into(_writable(target)[begin:end], offset)
            return
        try:
            buffer = scratch.get_nowait()
        except queue.Empty:
            buffer = torch.empty(chunk_bytes + 8, dtype=torch.uint8)
        try:
            shard.read_into(_writable(buffer)[: end - begin], offset)
            first, last = begin // source.itemsize, end // source.itemsize
            size = target.element_size()
            _prefault(target.data_ptr() + first * size, (last - first) * size)
            flat = target.reshape(-1)
            flat[first:last].copy_(buffer[: end - begin].view(source))
        finally:
            scratch.put(buffer)

    workers = max(1, min(len(tasks), _read_threads()))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="thaw-read") as pool:
        futures = [pool.submit(run, task) for task in tasks]
        try:
            for future in futures:
                future.result()
        except BaseException:
            # Leaving the block waits for reads already running: none may write
            # into a tensor after it is freed.
            for future in futures:
                future.cancel()
            raise
    return out


def _read_threads() -> int:
    """Threads for reads: one per usable CPU (at least two, so one thread's page
    faults overlap another's copy), at most 8 (memory bandwidth is spent by then)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(2, min(cpus, 8))

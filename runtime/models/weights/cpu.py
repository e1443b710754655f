"""The CPU read path: every byte of a bundle's shards copied into memory the process owns.

Nothing stays mapped: once a model is loaded no change to the bundle's files
(a rewrite, a truncation, another version copied over it) can reach its
answers or crash the process, and a shard that changes while it is read
fails the load.
"""

from __future__ import annotations

import bisect
import os
import stat
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.bundles import chunks
from runtime.bundles.chunks import read_into
from runtime.bundles.sources import pages
from runtime.bundles.stamps import Stamp, stamp_of
from runtime.errors import BundleError, IntegrityError
from runtime.models.weights.format import header_length, parse_header

if TYPE_CHECKING:
    import torch

    from runtime.bundles.chunks import Chunked
    from runtime.bundles.sources.landing import LandedShard

# One read task: large enough that syscalls and thread hand-offs vanish in the
# copy, small enough that a big tensor spreads over every read thread.
CHUNK_BYTES = 16 * 1024 * 1024
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _prefault(address: int, nbytes: int) -> None:
    """Map fresh memory for writing in one call, before a read fills it.

    Filling memory the process never touched costs a page fault per page, and
    those faults, not the copy, are most of a copying load. One
    MADV_POPULATE_WRITE per read has the kernel map the range in a loop instead
    of a trap per page: first loads of 1 GiB in fresh processes took 0.38-0.98 s
    against 0.64-1.09 s without it on this machine (median 0.69 vs 0.87 s).
    Best effort: older kernels refuse it (EINVAL) and the read faults as before.
    """
    # MADV_POPULATE_WRITE is Linux's: another kernel's madvise would read it as other advice.
    madvise = pages.madvise_fn() if sys.platform == "linux" else None
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
            # The bytes before the data, as read: a chunk digest covers them too.
            self.head = memoryview(prefix + raw)
            self.data_start = start
        except BaseException:
            os.close(self.fd)
            raise

    def changed(self) -> IntegrityError:
        return IntegrityError(
            f"{self.rel}: changed while it was being read (it is verified again on the next load)",
            file=self.rel,
        )

    def read_many(self, views: list[memoryview], offset: int) -> None:
        """Fill `views`, in order, from the file's consecutive bytes at `offset`."""
        read_into(self.fd, views, offset, self.rel, self.changed)

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


def wrap_landed(
    shard: Shard, landed: LandedShard, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The tensors of a shard a fetch landed in memory (runtime/bundles/sources/landing.py),
    as views of that memory (torch.frombuffer keeps it alive with them): no copy.

    The landing read the file `shard` opened since: the same stat and the same header
    bytes, or the load fails as for a shard changed while read. A floating tensor of
    another dtype than `dtype` (a landing avoids those) is converted, its bytes freed."""
    import torch

    opened = landed.opened
    if (
        opened is None
        or stamp_of(opened) != stamp_of(shard.opened)
        or landed.head != bytes(shard.head)
    ):
        raise shard.changed()
    out: dict[str, torch.Tensor] = {}
    buffers, landed.buffers = landed.buffers, {}
    for spec in shard.tensors:
        if not spec.nbytes:
            out[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)
            continue
        buffer = buffers.pop(spec.offset, None)
        if buffer is None or len(buffer) != spec.nbytes:
            raise shard.changed()
        tensor = torch.frombuffer(buffer, dtype=spec.dtype).reshape(spec.shape)
        if dtype is not None and spec.dtype.is_floating_point and spec.dtype != dtype:
            tensor = tensor.to(dtype)
        out[spec.name] = tensor
    return out


def read_shards(
    shards: list[Shard],
    dtype: torch.dtype | None,
    chunk_bytes: int = CHUNK_BYTES,
    on_progress: Callable[[int], None] | None = None,
    pending: Mapping[str, Chunked] | None = None,
) -> dict[str, torch.Tensor]:
    """Copy every tensor of `shards` into fresh memory of this process, in parallel,
    checking the digest of each chunk of a shard in `pending` from that memory.

    The tensors never view a file: safetensors' `load_file` hands out tensors
    that view a MAP_PRIVATE mapping of the shard, so a READY model read the
    bundle's files on every request. Rewriting one changed its answers, and
    truncating one killed the process with SIGBUS (copy-on-write pages of a
    private mapping are unmapped past a truncated end too). Reading with
    pread() never maps the file: a shard cut short during the read is a short
    read, refused, not a signal.

    Each tensor gets its own allocation (a model that keeps a few tensors frees
    the rest). The file is read in ranges spread over threads (pread, sha256 and
    torch's copies release the GIL), each range with one preadv into the tensors
    it spans: for a shard in `pending` (runtime/bundles/chunks.py) the ranges are
    its manifest's chunks, header included (from the bytes `Shard` read), each
    hashed from the memory it was read into, so every byte is read once and
    checked on whichever core read it; for the others, `chunk_bytes` of tensor
    data each. A tensor converted to `dtype` is read into a scratch buffer and
    converted from there, so the file's dtype never occupies memory in full.
    `on_progress(n)` is told each range's n bytes read, from the reading threads.
    On any failure every tensor is let go of before the error leaves.
    """
    try:
        out, tasks = _plan(shards, dtype, chunk_bytes, pending)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # what it allocated goes now
        raise
    partial = _Partial()
    if not tasks:
        return out

    def run(task: _Range) -> None:
        task.read(partial)
        if on_progress is not None:
            on_progress(task.stop - task.begin)

    # Hashing is CPU-bound: where chunks are checked, a thread for every core (to 16).
    hashing = any(task.entry is not None for task in tasks)
    workers = max(1, min(len(tasks), chunks.threads() if hashing else _read_threads()))
    try:
        chunks.run_all(tasks, run, workers, "thaw-read")
    except BaseException as exc:
        # Nothing read stays: the error's frames (the reading threads') held tensors.
        out.clear()
        tasks.clear()
        traceback.clear_frames(exc.__traceback__)
        raise
    return out


def _plan(
    shards: list[Shard],
    dtype: torch.dtype | None,
    chunk_bytes: int,
    pending: Mapping[str, Chunked] | None,
) -> tuple[dict[str, torch.Tensor], list[_Range]]:
    """Every tensor allocated, and the ranges to read into them. (A function of its
    own: its locals, which hold tensors, are gone once it returns, so that a failed
    read's error holds none.)"""
    import torch

    out: dict[str, torch.Tensor] = {}
    tasks: list[_Range] = []
    for shard in shards:
        placed: list[_Placed] = []
        for spec in shard.tensors:
            if spec.name in out:
                raise BundleError(f"tensor {spec.name!r} appears in two shards")
            convert = dtype is not None and spec.dtype.is_floating_point and spec.dtype != dtype
            target = torch.empty(spec.shape, dtype=dtype if convert else spec.dtype)
            out[spec.name] = target
            if spec.nbytes:
                placed.append(
                    _Placed(spec.offset, spec.nbytes, target, spec.dtype if convert else None)
                )
        entry = pending.get(shard.rel) if pending is not None else None
        tasks += ranges_of(shard, placed, entry, chunk_bytes)
    return out, tasks


def ranges_of(
    shard: Shard, placed: list[_Placed], entry: Chunked | None, step: int
) -> list[_Range]:
    """The ranges to read `shard` in: with `entry`, its manifest's chunks (the header
    too, each checked against its digest); else `step` bytes of tensor data each."""
    if entry is not None:
        spans = [
            (index, *chunks.chunk_span(entry.size, entry.chunk_bytes, index))
            for index in range(len(entry.chunks))
        ]
    else:
        size = shard.opened.st_size
        spans = [(-1, at, min(size, at + step)) for at in range(shard.data_start, size, step)]
    offsets = [p.offset for p in placed]
    return [
        _Range(
            shard,
            entry,
            index,
            begin,
            stop,
            placed,
            max(0, bisect.bisect_right(offsets, begin) - 1),
        )
        for index, begin, stop in spans
    ]


@dataclass
class _Placed:
    """A tensor's bytes in its shard, and where they go."""

    offset: int  # in the file
    nbytes: int
    target: torch.Tensor
    source: torch.dtype | None  # the file's dtype, when converting to target's


@dataclass
class _Range:
    """One range of a shard, read with one preadv into the tensors it spans."""

    shard: Shard
    entry: Chunked | None  # with the digest of chunk `index` to check, or None
    index: int
    begin: int
    stop: int
    placed: list[_Placed]
    first: int  # of `placed`, the first that may overlap

    def spans(self, lo: int) -> Iterator[tuple[_Placed, int, int]]:
        """Each tensor the range's data (from `lo`) reaches: its file bytes [start, end)."""
        for place in self.placed[self.first :]:
            if place.offset >= self.stop:
                break
            start, end = max(lo, place.offset), min(self.stop, place.offset + place.nbytes)
            if end > start:
                yield place, start, end

    def read(self, partial: _Partial) -> None:
        import torch

        head = self.shard.head[self.begin : min(self.stop, self.shard.data_start)]
        lo = max(self.begin, self.shard.data_start)
        views: list[memoryview] = []
        converts: list[tuple[_Placed, int, torch.Tensor]] = []
        for place, start, end in self.spans(lo):
            if place.source is None:
                _prefault(place.target.data_ptr() + start - place.offset, end - start)
                views.append(_writable(place.target)[start - place.offset : end - place.offset])
            else:
                # Offset so that the range's first whole element is aligned for a view.
                pad = (start - place.offset) % place.source.itemsize
                scratch = torch.empty(pad + end - start, dtype=torch.uint8)[pad:]
                converts.append((place, start - place.offset, scratch))
                views.append(_writable(scratch))
        self.shard.read_many(views, lo)
        if self.entry is not None:
            chunks.check(self.entry, self.index, [head, *views])
        for place, begin, scratch in converts:
            partial.convert(place, begin, scratch)


class _Partial:
    """Converting a tensor a range at a time: an element split between two ranges
    is converted by whichever range completes it (its bytes are gathered here)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[int, int], tuple[bytearray, list[int]]] = {}

    def convert(self, place: _Placed, begin: int, raw: torch.Tensor) -> None:
        """Convert `raw`, the bytes [begin, begin + len) of `place`'s source tensor."""
        import torch

        source = place.source
        assert source is not None
        size = source.itemsize
        end = begin + raw.numel()
        first, last = -(-begin // size), end // size
        flat = place.target.reshape(-1)
        if last > first:
            width = place.target.element_size()
            _prefault(place.target.data_ptr() + first * width, (last - first) * width)
            flat[first:last].copy_(raw[first * size - begin : last * size - begin].view(source))
        edges = {e for e in (begin // size, (end - 1) // size) if not first <= e < last}
        for element in edges:
            lo, hi = max(begin, element * size), min(end, (element + 1) * size)
            with self._lock:
                key = (id(place), element)
                buffer, filled = self._bytes.setdefault(key, (bytearray(size), [0]))
                buffer[lo - element * size : hi - element * size] = (
                    raw[lo - begin : hi - begin].numpy().tobytes()
                )
                filled[0] += hi - lo
                done = filled[0] == size
                if done:
                    del self._bytes[key]
            if done:
                flat[element : element + 1].copy_(torch.frombuffer(buffer, dtype=source))


def _read_threads() -> int:
    """Threads for reads: one per usable CPU (at least two, so one thread's page
    faults overlap another's copy), at most 8 (memory bandwidth is spent by then)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(2, min(cpus, 8))

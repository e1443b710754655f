"""Shards landed in memory while the framework imports: read once, checked where they stay.

The first load of an instance waits for `import torch` (1-2 s), which holds the
GIL for long stretches but leaves the disk and the other cores idle. A fetch
that leaves shards to the load (LocalSource.fetch_for_load) lands them instead:
each tensor of each shard gets anonymous memory of its own (a private mapping,
untouched until read), and reader threads read each chunk into the memory of
the tensors it spans and check its digest from there (preadv and hashlib
release the GIL), while the import runs. A shard the page cache holds is copied
out of it with one preadv per chunk; one it does not hold (a fresh node) is read
with O_DIRECT, from the disk into that memory, filling no page cache to be
copied out again (pages.py; docs/decisions/0021). After the
import the load wraps that memory as the tensors themselves (torch.frombuffer,
which keeps the mapping alive as long as the tensor): no byte is copied twice,
and no tensor reaches a builder before every chunk of its shard matched
(runtime/models/weights/loaded.py waits for them).

Only where the load would copy anyway: not on a read-only filesystem (those
shards are mapped: mapped.py), not where an accelerator may take the weights
(CUDA loads go through the staging pool), not where the load converts a
floating tensor to another dtype (the file's dtype would be held in full), and
only while the framework is not imported yet, so that the memory it takes before
the load reserves its budget is the instance's first and fits the memory
available now. Anything odd in a shard (a header it cannot lay out) leaves it to
the load, which says why. A landing nobody takes (a failed load, another
device) is let go of by `discard` (the source's `release`).
"""

from __future__ import annotations

import bisect
import collections
import errno
import mmap
import os
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import orjson

from runtime.bundles import chunks
from runtime.bundles.chunks import Chunked, read_into
from runtime.bundles.manifest import Manifest
from runtime.bundles.sources import pages
from runtime.errors import BundleError, IntegrityError

# One read of a shard without chunk digests (as cpu.py reads it).
READ_BYTES = 16 * 1024 * 1024
# Device nodes of an accelerator torch may pick: CUDA, ROCm (torch.cuda), WSL.
_ACCELERATORS = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
# Floating dtypes by safetensors code (a float8 is never a load dtype: it converts).
_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_FLOATS |= dict.fromkeys(("F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ"), "float8")
_LOAD_DTYPES = {
    **dict.fromkeys(("float32", "fp32"), "float32"),
    **dict.fromkeys(("float16", "fp16", "half"), "float16"),
    **dict.fromkeys(("bfloat16", "bf16"), "bfloat16"),
}
_lock = threading.Lock()
_in_flight_bytes = 0  # of landings not yet taken or discarded, in this process


class LandedShard:
    """One shard's tensors in anonymous memory: by file offset, the mapping that
    holds its bytes; `head` the bytes before the data. Read from its file
    (`open`), or filled as its parts arrive (arrival.py: `arrived` once whole)."""

    def __init__(self, rel: str, entry: Chunked | None, size: int, head: bytes) -> None:
        header_len = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
        if not 0 <= header_len <= size - 8 or len(head) != 8 + header_len:
            raise ValueError("header")
        self.rel = rel
        self.entry = entry
        self.size = size
        self.head = head
        self.data_start = 8 + header_len
        self.layout = _layout(head[8:], size - self.data_start)
        # By file offset: each tensor's bytes (an mmap, or a view of `direct`'s).
        self.buffers: dict[int, mmap.mmap | memoryview] = {}
        # Read with O_DIRECT (`direct_fd`): by file offset, each tensor's mapping and
        # the file offset of its first byte, a block boundary at or before the tensor.
        self.direct: dict[int, tuple[mmap.mmap, int]] = {}
        self.fd = -1
        self.direct_fd = -1
        self.direct_refused = False
        self.opened: os.stat_result | None = None
        self.arrived = False

    @classmethod
    def open(cls, path: Path, rel: str, entry: Chunked | None) -> LandedShard:
        """The shard at `path`, to be read (`read`) from the descriptor opened here."""
        fd = os.open(
            path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
        )
        try:
            opened = os.fstat(fd)
            prefix = os.pread(fd, 8, 0)
            header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 <= header_len <= min(opened.st_size - 8, 64 * 1024 * 1024):
                raise ValueError("header")
            shard = cls(rel, entry, opened.st_size, prefix + os.pread(fd, header_len, 8))
        except BaseException:
            os.close(fd)
            raise
        shard.fd, shard.opened = fd, opened
        aligned = entry is None or entry.chunk_bytes % pages.BLOCK == 0
        if aligned and not pages.cached(fd, opened.st_size):
            shard.direct_fd = pages.open_direct(path, opened)
        return shard

    def converts(self, target: str | None) -> bool:
        """Whether a floating tensor of it is of another dtype than `target`."""
        return target is not None and any(
            _FLOATS.get(code, target) != target for code in self.layout.codes
        )

    def allocate(self) -> None:
        for begin, stop in self.layout:
            if stop <= begin:
                continue
            offset, end = self.data_start + begin, self.data_start + stop
            if self.direct_fd < 0:
                self.buffers[offset] = mmap.mmap(-1, stop - begin, flags=mmap.MAP_PRIVATE)
                continue
            # Widened to blocks at both ends: the few bytes of its neighbours there
            # are read into it too, outside the tensor's own view.
            base = offset - offset % pages.BLOCK
            mapping = mmap.mmap(-1, end + -end % pages.BLOCK - base, flags=mmap.MAP_PRIVATE)
            self.direct[offset] = (mapping, base)
            self.buffers[offset] = memoryview(mapping)[offset - base : end - base]

    def ranges(self) -> list[tuple[int, int, int]]:
        """(chunk index or -1, start, end) to read: the manifest's chunks, else READ_BYTES
        of data; none once arrived."""
        if self.arrived:
            return []
        if self.entry is not None:
            count = len(self.entry.chunks)
            return [
                (i, *chunks.chunk_span(self.size, self.entry.chunk_bytes, i)) for i in range(count)
            ]
        # Whole blocks of the file (the first read starts where the data does), so that
        # no two reads touch the same bytes when they are direct.
        starts = range(self.data_start - self.data_start % READ_BYTES, self.size, READ_BYTES)
        return [(-1, at, min(self.size, at + READ_BYTES)) for at in starts]

    def read(self, index: int, begin: int, stop: int) -> None:
        """Read [begin, stop) into the tensors' memory (one preadv, or one direct read per
        tensor); check chunk `index`."""
        lo = max(begin, self.data_start)
        offsets = sorted(self.buffers)
        views: list[memoryview] = []
        for offset in offsets[max(0, bisect.bisect_right(offsets, lo) - 1) :]:
            if offset >= stop:
                break
            buffer = self.buffers[offset]
            start, end = max(lo, offset), min(stop, offset + len(buffer))
            if end > start:
                views.append(memoryview(buffer)[start - offset : end - offset])
        try:
            if self.direct_fd < 0 or self.direct_refused or not self._read_direct(lo, stop):
                for view in views:
                    pages.prefault(view, 0, len(view))
                read_into(self.fd, list(views), lo, self.rel, self.changed)
            if self.entry is not None:
                head = self.head[begin : min(stop, self.data_start)]
                chunks.check(self.entry, index, [head, *views])
        finally:
            for view in views:
                view.release()

    def _read_direct(self, lo: int, stop: int) -> bool:
        """Read [lo, stop) of the tensors with O_DIRECT, from the disk straight into their
        memory: no page-cache copy to fill and copy out, which in a microVM costs a
        host fault per guest page on top of the read (BENCHMARKS.md, bigload).
        Chunks are whole blocks, so no two chunks' reads touch the same bytes. False
        where the filesystem refuses direct reads: the buffered read takes over."""
        offsets = sorted(self.direct)
        for offset in offsets[max(0, bisect.bisect_right(offsets, lo) - 1) :]:
            if offset >= stop:
                break
            mapping, base = self.direct[offset]
            start, end = max(lo, offset), min(stop, offset + len(self.buffers[offset]))
            if end <= start:
                continue
            first = start - start % pages.BLOCK
            limit = min(end + -end % pages.BLOCK, base + len(mapping))
            pages.prefault(mapping, first - base, limit - first)
            target = memoryview(mapping)[first - base : limit - base]
            try:
                got = 0
                while first + got < end:
                    n = os.preadv(self.direct_fd, [target[got:]], first + got)
                    if n == 0:
                        raise self.changed()
                    got += n
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise BundleError(f"{self.rel}: read failed ({exc.strerror})") from exc
                # Refused (a block size past BLOCK): buffered from now on. The descriptor
                # stays open until `close`: another reader may be in a read on it.
                self.direct_refused = True
                return False
            finally:
                target.release()
        return True

    def changed(self) -> IntegrityError:
        return IntegrityError(
            f"{self.rel}: changed while it was being read (it is verified again on the next load)",
            file=self.rel,
        )

    def close(self) -> None:
        self.buffers, self.direct = {}, {}
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1


class Landing:
    """A bundle's shards landing in memory (see the module docstring).

    While the framework imports, one core is its: the reads run on one thread per
    core but one. The load's `wait` then reads what is left on its own thread too,
    so every core works once the import is done (on 2 cores, 6 GiB: the same total
    as a reader per core, with the import 1.3 s instead of 1.9-2.1 s)."""

    def __init__(self, shards: list[LandedShard]) -> None:
        global _in_flight_bytes
        self.nbytes = sum(s.size for s in shards)
        with _lock:
            _in_flight_bytes += self.nbytes
        self.shards = {s.rel: s for s in shards}
        self._tasks = collections.deque(
            (shard, index, begin, stop) for shard in shards for index, begin, stop in shard.ranges()
        )
        self._cond = threading.Condition()
        self._running = 0
        self._read_bytes = 0
        self._error: BaseException | None = None
        self._stopped = False
        self._done = False
        # A direct read's thread waits on the disk, not a core: one per core keeps the
        # disk busy while the others hash, even beside the import (decision 0021).
        direct = any(shard.direct_fd >= 0 for shard in shards)
        workers = min(len(self._tasks), max(1, chunks.threads() - (0 if direct else 1)))
        for number in range(workers):
            name = f"thaw-land-{number}"
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def wait(self, on_progress: Callable[[int], None] | None = None) -> None:
        """Return once every chunk is read and matched (reading what is left here too);
        else let go of everything and raise what failed first (a mismatch names the
        file and the chunk)."""
        told = 0
        try:
            while True:
                task = self._next()
                if task is None:
                    break
                self._run(task)
                read = self._read_bytes
                if on_progress is not None and read > told:
                    on_progress(read - told)
                    told = read
            with self._cond:
                while self._running:
                    self._cond.wait()
                error, self._error = self._error, None
            if on_progress is not None and self._read_bytes > told:
                on_progress(self._read_bytes - told)
            if error is not None:
                raise error
        except BaseException as exc:
            self.discard(wait=True)
            traceback.clear_frames(exc.__traceback__)
            raise

    def take(self, rel: str) -> LandedShard | None:
        """The landed shard `rel`, handed over (after `wait`): this object lets go of it."""
        shard = self.shards.pop(rel, None)
        if not self.shards:
            self._settle()
        return shard

    def discard(self, *, wait: bool = False) -> None:
        """Let go of every shard not taken; reads under way finish first (on a thread
        of their own, unless `wait`), as none may write into memory already freed."""
        with self._cond:
            self._stopped = True
            self._tasks.clear()
        shards, self.shards = list(self.shards.values()), {}
        self._settle()

        def finish() -> None:
            with self._cond:
                while self._running:
                    self._cond.wait()
                self._error = None
            for shard in shards:
                shard.close()

        if wait:
            finish()
        else:
            threading.Thread(target=finish, name="thaw-land-discard", daemon=True).start()

    def _next(self) -> tuple[LandedShard, int, int, int] | None:
        with self._cond:
            if self._stopped or self._error is not None or not self._tasks:
                return None
            self._running += 1
            return self._tasks.popleft()

    def _run(self, task: tuple[LandedShard, int, int, int]) -> None:
        shard, index, begin, stop = task
        try:
            shard.read(index, begin, stop)
        except BaseException as exc:
            with self._cond:
                if self._error is None:
                    self._error = exc
        finally:
            with self._cond:
                self._running -= 1
                self._read_bytes += stop - begin
                self._cond.notify_all()

    def _work(self) -> None:
        while True:
            task = self._next()
            if task is None:
                return
            self._run(task)

    def _settle(self) -> None:
        global _in_flight_bytes
        with _lock:
            if not self._done:
                self._done = True
                _in_flight_bytes -= self.nbytes


def should_land(directory: Path, nbytes: int) -> bool:
    """Whether landing `nbytes` of shards in `directory` now is this load's way (see the
    module docstring): the framework is still to import, no accelerator, a writable
    filesystem, and room in the memory available now."""
    if not hasattr(os, "preadv") or sys.platform != "linux" or nbytes <= 0:
        return False
    torch = sys.modules.get("torch")
    if torch is not None and not getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return False  # imported: the load reads at once, within its budget
    if any(os.path.exists(node) for node in _ACCELERATORS):
        return False
    while not directory.exists() and directory.parent != directory:
        directory = directory.parent  # a node cache the fetch is still to make
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return False
    except OSError:
        return False
    with _lock:
        return _in_flight_bytes + nbytes <= 0.8 * pages.available_bytes()


def load_dtype(manifest: Manifest) -> tuple[bool, str | None]:
    """Whether a landing can serve `manifest`'s load dtype, and that dtype's name."""
    target = _LOAD_DTYPES.get(manifest.load_dtype or "")
    return manifest.load_dtype is None or target is not None, target


def land(
    directory: Path,
    manifest: Manifest,
    pending: Mapping[str, Chunked],
    arrived: Mapping[str, LandedShard] | None = None,
) -> Landing | None:
    """Start landing the bundle's safetensors shards (those in `pending` checked chunk by
    chunk as they land; those `arrived` whole already as they are); None where no shard
    can be (the load reads them itself)."""
    ok, target = load_dtype(manifest)
    if not ok:
        return None
    arrived = arrived or {}
    shards: list[LandedShard] = []
    try:
        for f in manifest.files:
            if not f.path.endswith(".safetensors"):
                continue
            if f.path in arrived:
                shards.append(arrived[f.path])
                continue
            try:
                shard = LandedShard.open(directory / f.path, f.path, pending.get(f.path))
            except (OSError, ValueError):
                continue
            if shard.size != f.size or shard.converts(target):
                shard.close()
                continue
            shards.append(shard)
            shard.allocate()
    except BaseException:
        for shard in shards:
            shard.close()
        raise
    return Landing(shards) if shards else None


class _Layout(list[tuple[int, int]]):
    """A header's tensor byte ranges in its data section, in order; `codes` their dtypes."""

    codes: set[str]


def _layout(raw: bytes, data_bytes: int) -> _Layout:
    """The ranges a safetensors header lays out, torch-free: they must tile the data
    section exactly (so nothing past the file's size is allocated). ValueError if not;
    the load's own parse (format.py) checks the rest once torch is imported."""
    header = orjson.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("header")
    layout = _Layout()
    layout.codes = set()
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise ValueError("offsets")
        begin, stop = offsets
        if not (type(begin) is int and type(stop) is int and 0 <= begin <= stop):
            raise ValueError("offsets")
        layout.append((begin, stop))
        layout.codes.add(str(info.get("dtype")))
    layout.sort()
    end = 0
    for begin, stop in layout:
        if begin != end:
            raise ValueError("tiling")
        end = stop
    if end != data_bytes:
        raise ValueError("tiling")
    return layout

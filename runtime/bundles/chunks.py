"""Per-chunk digests: how a file is cut, hashed a chunk at a time, and checked in parallel.

A whole-file sha256 is one sequential pass: a 16 GB shard hashed on one core
takes longer than reading it from a fast disk. A manifest of format 2 also
lists, per file, the sha256 of each `chunk_bytes` range of it (the last one
shorter), so a load can check each range on whichever core holds it, from
the memory the range was read into (runtime/models/weights/cpu.py). The
whole-file digest stays: `thaw bundle verify`, a build and an S3 fetch check
both, and a manifest whose chunk digests disagree with its file digest fails
them (a load checks the chunk digests, which the bundle's id covers too).

`Pending` is what a local fetch leaves to the load: the shards it did not hash,
to be checked chunk by chunk as the load reads them, and the stamps to record
once they matched (runtime/bundles/stamps.py).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from runtime.errors import BundleError, IntegrityError

T = TypeVar("T")


class Chunked(Protocol):
    """A manifest's file entry (manifest.Chunked), as far as its chunks go."""

    @property
    def path(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def chunks(self) -> tuple[str, ...]: ...


# What `thaw bundle build` writes: large enough that a 280 GB bundle's digests fit a
# manifest (1 MiB), small enough that a 1 GB shard spreads over every core.
CHUNK_BYTES = 32 * 1024 * 1024
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 1024 * 1024 * 1024
# One read of a chunk checked from its file (not from memory that keeps it).
_READ_BYTES = 4 * 1024 * 1024


def sha256_file(path: Path, on_progress: Callable[[int], None] | None = None) -> str:
    """The file's sha256; `on_progress(n)` after each chunk of n bytes hashed."""
    return file_digests(path, 0, on_progress)[0]


def file_digests(
    path: Path, chunk_bytes: int, on_progress: Callable[[int], None] | None = None
) -> tuple[str, list[str]]:
    """The file's sha256 and, with `chunk_bytes`, that of each chunk (chunks.py), in one
    read: the chunk digests are updated on a second thread (hashlib releases the GIL)."""
    digest = hashlib.sha256()
    digests: list[str] = []
    part = hashlib.sha256()
    in_part = 0
    step = min(_READ_BYTES, chunk_bytes) if chunk_bytes else _READ_BYTES
    with open(path, "rb", buffering=0) as handle, ThreadPoolExecutor(1) as helper:
        buffer = bytearray(step)
        view = memoryview(buffer)
        while True:
            # Never past the current chunk's end: each read feeds one chunk digest.
            want = step if not chunk_bytes else min(step, chunk_bytes - in_part)
            n = handle.readinto(view[:want])
            if not n:
                break
            pending = helper.submit(part.update, view[:n]) if chunk_bytes else None
            digest.update(view[:n])
            if pending is not None:
                pending.result()
                in_part += n
                if in_part == chunk_bytes:
                    digests.append(part.hexdigest())
                    part, in_part = hashlib.sha256(), 0
            if on_progress is not None:
                on_progress(n)
    if in_part:
        digests.append(part.hexdigest())
    return digest.hexdigest(), digests


def chunk_count(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def chunk_span(size: int, chunk_bytes: int, index: int) -> tuple[int, int]:
    """The byte range [start, end) of chunk `index` of a file of `size` bytes."""
    start = index * chunk_bytes
    return start, min(size, start + chunk_bytes)


def mismatch(file: Chunked, index: int) -> IntegrityError:
    """The error for chunk `index` of `file` whose bytes do not match its digest."""
    start, end = chunk_span(file.size, file.chunk_bytes, index)
    return IntegrityError(
        f"{file.path}: sha256 mismatch in chunk {index} (bytes {start}-{end}): "
        "file changed or corrupt",
        file=file.path,
        chunk=index,
    )


def check(file: Chunked, index: int, parts: Iterable[memoryview | bytes]) -> None:
    """Refuse chunk `index` of `file` unless `parts`, in order, hash to its digest.

    hashlib releases the GIL for each part past 2 KiB, so chunks are checked on
    as many threads as call this."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    if digest.hexdigest() != file.chunks[index]:
        raise mismatch(file, index)


def _hash_span(fd: int, start: int, end: int) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(min(_READ_BYTES, max(1, end - start)))
    view = memoryview(buffer)
    at = start
    while at < end:
        n = os.preadv(fd, [view[: min(len(buffer), end - at)]], at)
        if n == 0:
            raise EOFError(at)
        digest.update(view[:n])
        at += n
    return digest.hexdigest()


def chunk_digests(path: Path, chunk_bytes: int = CHUNK_BYTES, workers: int = 0) -> list[str]:
    """The sha256 of each `chunk_bytes` range of the file at `path`, hashed in parallel."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        spans = [chunk_span(size, chunk_bytes, i) for i in range(chunk_count(size, chunk_bytes))]
        with ThreadPoolExecutor(max(1, min(len(spans), workers or threads()))) as pool:
            return list(pool.map(lambda span: _hash_span(fd, *span), spans))
    finally:
        os.close(fd)


def verify_chunks(
    path: Path,
    file: Chunked,
    *,
    workers: int = 0,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    """Check every chunk of `file` (at `path`) against its digest, reading the file in
    parallel: for loads that do not read the bytes into memory they keep (a device
    load through safetensors), and for a fetch that must return verified files."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size != file.size:
            raise IntegrityError(
                f"{file.path}: size does not match manifest size {file.size}", file=file.path
            )

        def one(index: int) -> None:
            start, end = chunk_span(file.size, file.chunk_bytes, index)
            try:
                actual = _hash_span(fd, start, end)
            except EOFError:
                raise IntegrityError(
                    f"{file.path}: changed while it was being verified", file=file.path
                ) from None
            if actual != file.chunks[index]:
                raise mismatch(file, index)
            if on_progress is not None:
                on_progress(end - start)

        count = len(file.chunks)
        with ThreadPoolExecutor(max(1, min(count, workers or threads()))) as pool:
            for future in [pool.submit(one, i) for i in range(count)]:
                future.result()
    finally:
        os.close(fd)


def threads() -> int:
    """Threads for hashing: one per usable CPU (at least two, so one's read overlaps
    another's hash), at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(2, min(cpus, 16))


class Landed(Protocol):
    """Shards a fetch is reading into the memory their tensors will keep, checking each
    chunk as it lands (runtime/bundles/sources/landing.py `Landing`)."""

    @property
    def nbytes(self) -> int: ...
    def wait(self, on_progress: Callable[[int], None] | None = None) -> None: ...
    def take(self, rel: str) -> Any: ...
    def discard(self, *, wait: bool = False) -> None: ...


@dataclass
class Pending:
    """Shards a fetch left unhashed, for the load to check chunk by chunk as it reads
    them (each byte read once): by path, and what to do once all of them matched."""

    files: dict[str, Chunked] = field(default_factory=dict)
    # Records the shards' stamps (stamps.py): called with the stat each had when
    # the load opened it, once every chunk of every one of them matched.
    on_verified: Callable[[dict[str, os.stat_result]], None] | None = None
    # The shards landing in memory already (the load takes them, checked, as its tensors).
    landing: Landed | None = None

    def __bool__(self) -> bool:
        return bool(self.files)

    def verified(self, stats: dict[str, os.stat_result]) -> None:
        if self.on_verified is not None:
            self.on_verified({rel: st for rel, st in stats.items() if rel in self.files})


@dataclass(frozen=True)
class Fetched:
    """A fetched bundle: its directory, the stat stamps of its shards as the fetch
    returned, and the shards whose digests the load checks as it reads them."""

    directory: Path
    stamps: dict[str, tuple[int, int, int, int, int]]
    pending: Pending = field(default_factory=Pending)


# Buffers per preadv (the kernel's IOV_MAX is 1024).
_IOV_MAX = 512


def read_into(
    fd: int, views: list[memoryview], at: int, rel: str, changed: Callable[[], Exception]
) -> None:
    """Fill `views`, in order, from the consecutive bytes of `fd` (the bundle file
    `rel`) at `at`, as few preadv calls as it takes; `changed()` is raised where
    the file ends early (it was truncated after its size was checked)."""
    views = [view for view in views if len(view)]
    while views:
        try:
            n = os.preadv(fd, views[:_IOV_MAX], at)
        except OSError as exc:
            raise BundleError(f"{rel}: read failed ({exc.strerror})") from exc
        if n == 0:
            raise changed()
        at += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def run_all(tasks: list[T], run: Callable[[T], object], workers: int, name: str) -> None:
    """`run(task)` for every task on `workers` threads named `name`; the first error is
    raised once every read already running has ended (the tasks not yet begun are
    cancelled), so no thread writes into memory its caller frees on that error."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as pool:
        futures = [pool.submit(run, task) for task in tasks]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise

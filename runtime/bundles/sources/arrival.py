"""A shard landing in memory as its parts arrive from S3, while the node cache is written.

A fresh node's first load would otherwise download every byte into the node
cache and then read it all back. Here each range a fetch thread writes to the
cache file is also copied into the anonymous memory its tensors will keep
(landing.py `LandedShard`), and each chunk of a shard with chunk digests is
checked from that memory as soon as its last byte arrived, on the thread that
completed it: a corrupt part fails the fetch naming the file and the chunk,
before the whole file has arrived. The load then takes the memory as the
tensors (runtime/models/weights/loaded.py) and reads nothing back.

The header comes first: the memory for each tensor is laid out from it. Until
the first range's stream has brought the whole header, the other ranges that
arrive are only written to the cache file; once it has, what they wrote is read
back from the page cache into memory (a few reads of the file's first moments),
and every later write lands at once. A shard whose header a landing cannot
serve (landing.py) is dropped here and read by the load as before.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from runtime.bundles import chunks
from runtime.bundles.chunks import Chunked
from runtime.bundles.manifest import Manifest
from runtime.bundles.sources.landing import LandedShard, Landing, land, load_dtype, should_land

log = logging.getLogger("thaw.bundles")

# Reads back what arrived before the header: (offset, nbytes) -> bytes, from the cache file.
ReadBack = Callable[[int, int], bytes]


class ArrivingShard:
    """One shard's bytes, landing as they arrive (see the module docstring)."""

    def __init__(self, rel: str, size: int, entry: Chunked | None, dtype: str | None) -> None:
        self.rel = rel
        self.size = size
        self.entry = entry
        self._dtype = dtype
        self._lock = threading.Lock()
        self._early: list[tuple[int, int]] = []  # arrived before the header was known
        self._prefix = 0  # bytes from 0 that arrived in order (the first range's stream)
        self._landed = 0
        self._chunk_landed = [0] * (len(entry.chunks) if entry is not None else 0)
        self.shard: LandedShard | None = None
        self.dropped = False

    def write(self, offset: int, data: bytes | memoryview, read_back: ReadBack) -> None:
        """`data`, already written to the cache file at `offset`, lands in memory too;
        a chunk it completes is checked (IntegrityError naming the file and the chunk)."""
        with self._lock:
            if self.dropped:
                return
            if self.shard is None:
                self._early.append((offset, offset + len(data)))
                if offset <= self._prefix:
                    self._prefix = max(self._prefix, offset + len(data))
                if not self._header_known(read_back):
                    return
                assert self.shard is not None
                early, self._early = self._early, []
                done = [
                    i
                    for begin, end in early
                    for i in self._land(begin, read_back(begin, end - begin))
                ]
                for index in done:
                    self._check(index)
                return
        self._copy(offset, data)
        with self._lock:
            done = self._count(offset, offset + len(data)) if not self.dropped else []
        for index in done:
            self._check(index)

    def complete(self) -> LandedShard | None:
        """The landed shard once every byte arrived (not dropped); else None."""
        with self._lock:
            if self.dropped or self.shard is None or self._landed != self.size:
                return None
            self.shard.arrived = True
            return self.shard

    def close(self) -> None:
        with self._lock:
            self.dropped = True
            shard, self.shard = self.shard, None
        if shard is not None:
            shard.close()

    def _header_known(self, read_back: ReadBack) -> bool:
        """Lay the memory out once the header has arrived whole; False until then
        (or for good, when this shard is dropped)."""
        if self._prefix < 8:
            return False
        header_len = int.from_bytes(read_back(0, 8), "little")
        if self._prefix < 8 + header_len:
            return False
        try:
            shard = LandedShard(self.rel, self.entry, self.size, read_back(0, 8 + header_len))
            if shard.converts(self._dtype):
                raise ValueError("converts")
            shard.allocate()
        except (ValueError, OSError):
            self.dropped = True
            self._early = []
            return False
        self.shard = shard
        return True

    def _land(self, offset: int, data: bytes | memoryview) -> list[int]:
        """Copy `data` into the tensors' memory and count it (under the lock); the
        chunks it completed."""
        self._copy(offset, data)
        return self._count(offset, offset + len(data))

    def _copy(self, offset: int, data: bytes | memoryview) -> None:
        shard = self.shard
        if shard is None:
            return
        end = offset + len(data)
        source = memoryview(data)
        for at, buffer in shard.buffers.items():
            start, stop = max(offset, at), min(end, at + len(buffer))
            if stop > start:
                memoryview(buffer)[start - at : stop - at] = source[start - offset : stop - offset]

    def _count(self, offset: int, end: int) -> list[int]:
        """Count [offset, end) landed (the caller holds the lock); the chunks completed."""
        self._landed += end - offset
        done: list[int] = []
        if self.entry is not None and end > offset:
            step = self.entry.chunk_bytes
            for index in range(offset // step, (end - 1) // step + 1):
                lo, hi = chunks.chunk_span(self.size, step, index)
                self._chunk_landed[index] += min(hi, end) - max(lo, offset)
                if self._chunk_landed[index] == hi - lo:
                    done.append(index)
        return done

    def _check(self, index: int) -> None:
        shard = self.shard
        entry = self.entry
        if shard is None or entry is None:
            return
        begin, stop = chunks.chunk_span(self.size, entry.chunk_bytes, index)
        views = []
        for at, buffer in sorted(shard.buffers.items()):
            start, end = max(begin, at), min(stop, at + len(buffer))
            if end > start:
                views.append(memoryview(buffer)[start - at : end - at])
        try:
            chunks.check(entry, index, [shard.head[begin : min(stop, shard.data_start)], *views])
        finally:
            for view in views:
                view.release()


def arrivals_for(cache_dir: Path, manifest: Manifest) -> dict[str, ArrivingShard] | None:
    """An empty map for a fetch to fill with the shards it downloads (`sink`s of their
    transfers), where this load lands them (landing.py `should_land`); else None."""
    nbytes = sum(f.size for f in manifest.files if f.path.endswith(".safetensors"))
    if not load_dtype(manifest)[0] or not should_land(cache_dir, nbytes):
        return None
    return {}


def settle(
    directory: Path, manifest: Manifest, arrivals: dict[str, ArrivingShard] | None
) -> Landing | None:
    """After the fetch: the landing of its shards (those that arrived whole as they are,
    the others read from the node cache during the import), or None without `arrivals`.
    Arrivals it does not keep are let go of."""
    if arrivals is None:
        return None
    arrived: dict[str, LandedShard] = {}
    landing = None
    try:
        for rel, arriving in arrivals.items():
            shard = arriving.complete()
            if shard is not None:
                shard.opened = os.stat(directory / rel, follow_symlinks=False)
                arrived[rel] = shard
        landing = land(directory, manifest, {}, arrived)
    finally:
        for rel, arriving in arrivals.items():
            if landing is None or rel not in arrived:
                arriving.close()
    if landing is not None:
        log.info(
            "%s: landing %.1f MiB of shards in memory while the framework imports "
            "(%d arrived with the fetch)",
            manifest.short_id,
            landing.nbytes / 2**20,
            len(arrived),
        )
    return landing

"""One file arriving in byte ranges: written in place, hashed in order, renamed when verified.

Ranges arrive from several threads in any order, but sha256 must see the bytes
in file order. Each write advances the hash over the contiguous prefix that
has reached disk: bytes written at the frontier are hashed straight from the
buffer, and a range that finished early is read back (from the page cache)
when the frontier reaches it. So hashing overlaps the download and the file is
never read twice from the network, nor held whole in memory.

The data goes to a temporary name in the bundle directory; `finish()` renames
it to its manifest path only when size and hash match, and `discard()` removes
whatever is left after a failure. With a `sink` (arrival.py), every range written
also lands in the memory a load will keep, checked chunk by chunk as it arrives.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

from runtime.bundles.manifest import BundleFile, sha256_file
from runtime.bundles.sources.arrival import ArrivingShard
from runtime.errors import IntegrityError

_READBACK_BYTES = 4 * 1024 * 1024


class FileTransfer:
    """A bundle file being fetched into `final` via a temporary file."""

    TMP_PREFIX = ".thaw-tmp-"

    def __init__(
        self,
        file: BundleFile,
        final: Path,
        directory: Path,
        index: int,
        key: str,
        sink: ArrivingShard | None = None,
    ) -> None:
        self.file = file
        self.sink = sink
        self.final = final
        self.key = key
        self.tmp = directory / f"{self.TMP_PREFIX}{index}-{os.getpid()}-{threading.get_ident()}"
        self._fd: int | None = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(self._fd, file.size)
        self._lock = threading.Lock()
        self._hash = hashlib.sha256()
        self._hashed = 0
        self._written: dict[int, int] = {}  # range start -> bytes written from it
        self._ends: dict[int, int] = {}
        self._open_ranges = 0

    @staticmethod
    def already_verified(final: Path, file: BundleFile) -> bool:
        """A file a killed fetch renamed into place: re-hash it rather than download."""
        try:
            st = final.lstat()
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != file.size:
            return False
        return sha256_file(final) == file.sha256

    def ranges(self, part_bytes: int) -> list[tuple[int, int]]:
        size = self.file.size
        spans = [(s, min(s + part_bytes, size)) for s in range(0, size, part_bytes)] or [(0, 0)]
        for start, end in spans:
            self._written[start] = 0
            self._ends[start] = end
        self._open_ranges = len(spans)
        return spans

    def size_mismatch(self, relation: str) -> IntegrityError:
        return IntegrityError(
            f"{self.file.path}: stored object is {relation} its manifest size {self.file.size}",
            file=self.file.path,
        )

    def write(self, offset: int, data: bytes) -> None:
        """Write `data` at `offset` (inside a range) and advance the in-order hash."""
        fd = self._require_fd()
        if offset + len(data) > self.file.size:
            raise self.size_mismatch("larger than")
        os.pwrite(fd, data, offset)
        with self._lock:
            start = max(s for s in self._written if s <= offset)
            self._written[start] = offset + len(data) - start
            if offset == self._hashed:
                self._hash.update(data)
                self._hashed += len(data)
            self._catch_up(fd)
        if self.sink is not None:
            self.sink.write(offset, data, self._read_back)

    def _read_back(self, offset: int, nbytes: int) -> bytes:
        """Bytes this transfer wrote already (from the page cache)."""
        fd = self._require_fd()
        parts = []
        while nbytes > 0:
            part = os.pread(fd, nbytes, offset)
            if not part:
                break
            parts.append(part)
            offset += len(part)
            nbytes -= len(part)
        return b"".join(parts)

    def _frontier(self) -> int:
        """End of the contiguous prefix on disk."""
        for start in sorted(self._written):
            reached = start + self._written[start]
            if reached < self._ends[start]:
                return reached
        return self.file.size

    def _catch_up(self, fd: int) -> None:
        frontier = self._frontier()
        while self._hashed < frontier:
            chunk = os.pread(fd, min(_READBACK_BYTES, frontier - self._hashed), self._hashed)
            if not chunk:
                break
            self._hash.update(chunk)
            self._hashed += len(chunk)

    def part_done(self) -> bool:
        """Count a finished range; True for the last one."""
        with self._lock:
            self._open_ranges -= 1
            return self._open_ranges == 0

    def finish(self) -> None:
        """Check size and hash, then rename into place."""
        fd = self._require_fd()
        with self._lock:
            self._catch_up(fd)
            hashed, digest = self._hashed, self._hash.hexdigest()
        if hashed != self.file.size:
            raise self.size_mismatch("shorter than")
        if digest != self.file.sha256:
            raise IntegrityError(
                f"{self.file.path}: sha256 mismatch (stored object changed or corrupt)",
                file=self.file.path,
            )
        os.close(fd)
        self._fd = None
        self.final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.tmp, self.final)

    def discard(self) -> None:
        """Close and remove the temporary file if it is still there."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.tmp.unlink(missing_ok=True)

    def _require_fd(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"{self.file.path}: transfer already finished")
        return self._fd

"""Bundles in a local directory: `<root>/<name>/bundle.json`.

Fetching a local bundle copies nothing; it verifies every file in place, so a
corrupt or tampered shard is refused before any tensor is read. With stamps
(the runtime passes them), a file unchanged since it was verified on this
node is not hashed again (stamps.py).

For a load (`fetch_for_load`) a shard whose manifest lists chunk digests
(format 2) is not hashed here: the load checks each chunk as it reads it into
the memory that keeps it (runtime/bundles/chunks.py), so each byte is read
once. A shard with only a whole-file digest (format 1) is hashed here, as
before, and the load reads it again: a one-line note says that rebuilding the
bundle makes its loads faster (where its shards are larger than a chunk).
While the framework is still to import, the shards land in memory at once
(landing.py): the load finds them read and checked; else the kernel is asked
to read them ahead.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from runtime.bundles.chunks import CHUNK_BYTES, Fetched, Pending
from runtime.bundles.manifest import MANIFEST, Manifest, read_manifest
from runtime.bundles.sources.landing import Landing, land, should_land
from runtime.bundles.sources.source import Progress
from runtime.bundles.stamps import VerifiedStamps, shard_stamps
from runtime.bundles.verify import verify_files
from runtime.errors import BundleError, UnknownBundle

log = logging.getLogger("thaw.bundles")
# One readahead request: the kernel's read of it is asynchronous, its submission not.
_AHEAD_BYTES = 64 * 1024 * 1024


def read_ahead(paths: list[Path]) -> threading.Thread | None:
    """Have the kernel read `paths` into the page cache now, on a thread of its own.

    A fetch that leaves the shards to the load returns at once, and the load then
    waits for the framework's import (the first of an instance) and for memory
    before it reads a byte: the disk would idle meanwhile. Asked ahead, it reads
    them while the import runs; the load's reads then find them in memory. Best
    effort: where the kernel will not, the load reads them itself."""
    if not paths or not hasattr(os, "posix_fadvise"):
        return None

    def ask() -> None:
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue  # the load opens it and says why
            try:
                size = os.fstat(fd).st_size
                for at in range(0, size, _AHEAD_BYTES):
                    os.posix_fadvise(fd, at, min(_AHEAD_BYTES, size - at), os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    thread = threading.Thread(target=ask, name="thaw-read-ahead", daemon=True)
    thread.start()
    return thread


class LocalSource:
    def __init__(self, root: Path, stamps: VerifiedStamps | None = None) -> None:
        self.root = root
        self.stamps = stamps
        # Landings not yet let go of, by manifest id (`release` discards what the load left).
        self._landings: dict[str, Landing] = {}

    def describe(self) -> str:
        return str(self.root)

    def _dir(self, name: str) -> Path:
        if "/" in name or name.startswith(".") or not name:
            raise UnknownBundle(f"no bundle named {name!r}")
        return self.root / name

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / MANIFEST).is_file())

    def manifest(self, name: str) -> Manifest:
        directory = self._dir(name)
        if not (directory / MANIFEST).is_file():
            raise UnknownBundle(f"no bundle named {name!r} in {self.root}")
        manifest = read_manifest(directory)
        if manifest.name != name:
            raise BundleError(f"{directory}: manifest names {manifest.name!r}, expected {name!r}")
        return manifest

    def fetch(self, manifest: Manifest, on_progress: Progress) -> Path:
        directory = self._dir(manifest.name)
        verify_files(directory, manifest, on_progress=on_progress, stamps=self.stamps)
        return directory

    def fetch_for_load(self, manifest: Manifest, on_progress: Progress) -> Fetched:
        directory = self._dir(manifest.name)
        pending = Pending()
        hashed = verify_files(
            directory, manifest, on_progress=on_progress, stamps=self.stamps, pending=pending
        )
        whole = [f for f in manifest.files if f.path.endswith(".safetensors") and not f.chunks]
        # Said where it matters: a shard of a chunk or less is hashed on one core anyway.
        if hashed and sum(f.size for f in whole) > CHUNK_BYTES:
            log.info(
                "%s: hashed %s whole before reading it again (a bundle of format %d); "
                "rebuilding it with `thaw bundle build` makes its loads faster",
                manifest.short_id,
                whole[0].path if len(whole) == 1 else f"{len(whole)} shards",
                manifest.format,
            )
        stamps = shard_stamps(directory, [f.path for f in manifest.files])
        shards = [f for f in manifest.files if f.path.endswith(".safetensors")]
        nbytes = sum(f.size for f in shards)
        if should_land(directory, nbytes):
            pending.landing = land(directory, manifest, pending.files)
            if pending.landing is not None:
                log.info(
                    "%s: landing %.1f MiB of shards in memory while the framework imports",
                    manifest.short_id,
                    pending.landing.nbytes / 2**20,
                )
        if pending.landing is not None:
            old = self._landings.pop(manifest.id, None)
            if old is not None:
                old.discard()
            self._landings[manifest.id] = pending.landing  # type: ignore[assignment]
        else:
            read_ahead([directory / rel for rel in stamps])
        return Fetched(directory, stamps, pending)

    def release(self, manifest: Manifest) -> None:
        """The files are the user's, and never removed; what landed of them and the load
        did not take is let go of."""
        landing = self._landings.pop(manifest.id, None)
        if landing is not None:
            landing.discard()

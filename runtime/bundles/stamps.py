"""Which local bundle files were verified, and unchanged since, by their stat.

Hashing a local bundle runs at a quarter of the speed of reading it (SHA-256
is CPU-bound), so verifying it in place cost about four times the load
itself, on every load. As git trusts its index, a file whose (device, inode, size,
mtime, ctime) are what they were when its sha256 last matched is taken as
verified without reading it. Changing a file's content changes its ctime,
which no unprivileged process can set back.

A file changed within the filesystem's timestamp granularity of being
stamped could keep the same stat (git's "racily clean" case), so a file is
stamped only if it had not changed for RACY_S before its verification began.
A freshly written bundle is therefore hashed on every load for its first
seconds, then once.

The stamps are one JSON file in the state directory, shared by every process
of the node (an emulator's instances, a restarted server). It is rewritten
whole (write, then rename); concurrent writers lose only each other's
newest stamps, which costs a hash, never trust. An unwritable state directory
costs the saved stamps (they are kept in memory; the next process hashes
again), never the load: it is logged once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import orjson

from runtime.clock import SYSTEM, Clock

log = logging.getLogger("thaw.bundles")

RACY_S = 2.0
# Bundle versions remembered; the oldest are forgotten first.
MAX_BUNDLES = 64

Stamp = tuple[int, int, int, int, int]


def stamp_of(st: os.stat_result) -> Stamp:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def shard_stamps(bundle_dir: Path, paths: list[str]) -> dict[str, Stamp]:
    """The stat stamps of a bundle's shards, taken as its fetch returns: the files its
    hashes vouched for, or the load's will (a load refuses a shard whose stat differs)."""
    stamps: dict[str, Stamp] = {}
    for rel in paths:
        if rel.endswith(".safetensors"):
            with contextlib.suppress(FileNotFoundError):  # the load says so, naming it
                stamps[rel] = stamp_of(os.stat(bundle_dir / rel, follow_symlinks=False))
    return stamps


class VerifiedStamps:
    """Stat stamps of verified files, per bundle version and directory, kept in `path`."""

    def __init__(self, path: Path, *, clock: Clock = SYSTEM) -> None:
        self.path = path
        # Compared with the files' mtime and ctime, which are the kernel's wall clock.
        self.clock = clock
        self._lock = threading.Lock()
        self._stamps: dict[str, dict[str, Stamp]] | None = None
        # Whether the last write failed (logged when that starts and when it ends).
        self._unwritable = False

    def now_ns(self) -> int:
        """The wall clock now, in ns: when a verification pass begins."""
        return int(self.clock.wall() * 1e9)

    @staticmethod
    def key(bundle_dir: Path, manifest_id: str) -> str:
        return f"{manifest_id}:{bundle_dir.resolve()}"

    def _loaded(self) -> dict[str, dict[str, Stamp]]:
        if self._stamps is None:
            self._stamps = {}
            with contextlib.suppress(OSError, orjson.JSONDecodeError, TypeError, ValueError):
                raw: Any = orjson.loads(self.path.read_bytes())
                # Anything unreadable is forgotten: it only costs a hash.
                self._stamps = {
                    str(key): {str(rel): tuple(map(int, s)) for rel, s in files.items()}  # type: ignore[misc]
                    for key, files in raw.items()
                }
        return self._stamps

    def unchanged(self, key: str, rel: str, st: os.stat_result) -> bool:
        """True when `rel` was verified in this bundle and its stat is the same since."""
        with self._lock:
            files = self._loaded().get(key)
            return files is not None and files.get(rel) == stamp_of(st)

    def record(self, key: str, stamps: dict[str, os.stat_result], verified_from_ns: int) -> None:
        """Remember files verified in a pass that began at `verified_from_ns` (`now_ns()`)."""
        settled_before = verified_from_ns - int(RACY_S * 1e9)
        fresh = {
            rel: stamp_of(st)
            for rel, st in stamps.items()
            if max(st.st_mtime_ns, st.st_ctime_ns) < settled_before
        }
        if not fresh:
            return
        with self._lock:
            known = self._loaded()
            # Added to the version's others (a fetch stamps some files, the load that
            # checked the rest as it read them stamps those): a changed file's old
            # stamp matches no stat, so keeping it costs nothing.
            known[key] = {**known.pop(key, {}), **fresh}
            while len(known) > MAX_BUNDLES:
                known.pop(next(iter(known)))
            body = orjson.dumps(known)
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temp.write_bytes(body)
            temp.replace(self.path)
        except OSError as exc:
            # The stamps only spare a hash: the verified load goes on without them.
            with contextlib.suppress(OSError):
                temp.unlink()
            with self._lock:
                first, self._unwritable = not self._unwritable, True
            if first:
                log.warning(
                    "verified-file stamps cannot be saved (%s); they are kept in memory only",
                    exc,
                )
            return
        with self._lock:
            recovered, self._unwritable = self._unwritable, False
        if recovered:
            log.info("verified-file stamps are saved again to %s", self.path)

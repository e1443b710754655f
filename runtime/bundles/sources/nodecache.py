"""The node cache: where a fetched bundle version lives, and whether it is complete.

    <cache>/<name>/<manifest sha256>/      the files, bundle.json, and last of all
                                           .thaw-fetched (the manifest id)
    <cache>/<name>/<manifest sha256>/.thaw-use
                                           shared-locked by every process using it
    <cache>/<name>.<manifest sha256>.lock  held while one process fills the directory;
                                           it holds the room that fill reserved
    <cache>/.thaw-room                     held while a fetch checks and reserves room

The directory is named by the manifest's hash, so a new version never collides
with the old one. The marker is written last, after every file was verified:
a directory whose marker names the manifest and whose files all have their
sizes is complete. The lock is an flock, so it is shared by every process on
the node (Lambda sandboxes reusing /tmp, containers sharing a volume) and is
released by the kernel if its holder dies.

A fetch asks for room first (`ensure_room`): the files it is about to write,
each rounded up to the filesystem's blocks, must fit in the space free to us,
less what the other fills under way on the node have reserved and not yet
written (each reservation is in its fill's lock file; one fetch checks and
reserves at a time). A bundle that cannot fit fails its load at once, naming
the sizes, before a byte is downloaded, rather than filling the disk that the
job store and the platform (Lambda's /tmp) share with it. A disk that fills
anyway (a writer that is not a fetch) ends the fetch with the same error
(`out_of_room`), and the fetch removes everything it wrote.

Versions no process uses are removed (`prune`), so the cache holds what is in
use plus one version of each bundle, not every version a long-lived node has
seen (a bundle updated in S3 five times would otherwise fill Lambda's /tmp,
and every load after that would fail for room). A process holds a shared lock
on a version (`hold`) from its fetch until the model leaves its memory; a
version is removed only under an exclusive lock nobody else holds, renamed
away first so no one finds it complete, then deleted. Once a version is
fetched, the bundle's other versions go; when a fetch finds too little room,
unused versions of any bundle go, least recently held first, before it gives up.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from runtime.bundles.manifest import BundleFile, Manifest, write_manifest
from runtime.errors import LoadFailed

MARKER = ".thaw-fetched"
USE_LOCK = ".thaw-use"
# Held while a fetch checks and reserves room: <cache>/.thaw-room.
_ROOM_LOCK = ".thaw-room"
# A version directory renamed away for removal: <cache>/<name>/.thaw-gone-<version>-<pid>.
_GONE = ".thaw-gone-"
# The manifest and the marker, written after the files: a block each is plenty.
_OWN_FILES_BLOCKS = 2
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})


def version_dir(cache_dir: Path, manifest: Manifest) -> Path:
    return cache_dir / manifest.name / manifest.id.partition(":")[2]


def is_complete(directory: Path, manifest: Manifest) -> bool:
    """The marker names this manifest and every file is there at its size."""
    try:
        if (directory / MARKER).read_text().strip() != manifest.id:
            return False
        for f in manifest.files:
            st = (directory / f.path).lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                return False
    except OSError:
        return False
    return True


def mark_complete(directory: Path, manifest: Manifest) -> None:
    """Write bundle.json (so the directory is a bundle itself), then the marker."""
    write_manifest(directory, manifest)
    tmp = directory / f"{MARKER}.tmp"
    tmp.write_text(manifest.id + "\n")
    os.replace(tmp, directory / MARKER)


def ensure_room(directory: Path, manifest: Manifest, files: list[BundleFile]) -> None:
    """Reserve room for `files` (and the marker), each rounded up to whole blocks, in
    the free space under `directory`, or raise LoadFailed. Needs the version's
    filling lock (the reservation is written into it, and goes with it).

    Other fills under way on the node count with what they have yet to write, so
    two fetches started together cannot both pass and then fill the disk between
    them. Short of room, unused versions of any bundle go first (least recently
    held first), and what killed removals left.
    """
    cache_dir = directory.parent.parent
    fs = os.statvfs(directory)
    block = fs.f_frsize or fs.f_bsize or 4096
    needed = (sum(-(-f.size // block) for f in files) + _OWN_FILES_BLOCKS) * block
    own = _fill_lock(cache_dir, manifest)
    room = _locked(cache_dir / _ROOM_LOCK, fcntl.LOCK_EX, os.O_RDWR)  # one check at a time
    try:

        def free() -> tuple[int, int]:
            pending = _pending(cache_dir, own)
            return os.statvfs(directory).f_bavail * block - pending, pending

        available, pending = free()
        if needed > available:
            for bundle_dir in _bundle_dirs(cache_dir):  # what killed removals left, first
                _clear_gone(bundle_dir)
            available, pending = free()
            for version in sorted(_all_versions(cache_dir), key=_last_held):
                if needed <= available:
                    break
                if version != directory and _remove_unused(version):
                    available, pending = free()
        if needed > available:
            lead = f"bundle {manifest.name!r} needs {_mib(needed)}"
            raise _room_error(lead, directory, max(0, available), pending)
        own.write_text(f"{needed} {_usage(directory)}\n")
    finally:
        (cache_dir / _ROOM_LOCK).unlink(missing_ok=True)  # as `filling` does its own
        os.close(room)


def _fill_lock(cache_dir: Path, manifest: Manifest) -> Path:
    return cache_dir / f"{manifest.name}.{version_dir(cache_dir, manifest).name}.lock"


def _pending(cache_dir: Path, own: Path) -> int:
    """Bytes the fills under way (other than `own`) have reserved and not yet written."""
    pending = 0
    for lock in cache_dir.glob("*.lock"):
        if lock == own:
            continue
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # released (and removed) meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                continue  # nobody fills under it: no reservation
            except BlockingIOError:
                pass
            reserved, _, base = os.pread(fd, 64, 0).decode(errors="replace").partition(" ")
            if not (reserved.strip().isdigit() and base.strip().isdigit()):
                continue  # its fill has not reserved yet (it will, under the room lock)
            name, _, version = lock.name.removesuffix(".lock").rpartition(".")
            written = _usage(cache_dir / name / version) - int(base)
            pending += max(0, int(reserved) - written)
        finally:
            os.close(fd)
    return pending


def _usage(directory: Path) -> int:
    """Bytes the files under `directory` take on disk."""
    total = 0
    for path in directory.rglob("*"):
        with contextlib.suppress(OSError):
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512
    return total


def out_of_room(exc: BaseException, directory: Path, manifest: Manifest) -> LoadFailed | None:
    """The LoadFailed for a write that found the disk full (ENOSPC, a quota), else None."""
    if not isinstance(exc, OSError) or exc.errno not in _NO_ROOM:
        return None
    try:  # the version's directory may be gone already: ask the cache's root
        fs = os.statvfs(directory.parent.parent)
        free = fs.f_bavail * fs.f_frsize
    except OSError:
        free = 0
    size = _mib(manifest.total_bytes)
    lead = f"the disk filled while bundle {manifest.name!r} ({size}) was fetched"
    return _room_error(lead, directory, free)


def _mib(size: int) -> str:
    return f"{size / (1024 * 1024):.1f} MiB"


def _room_error(lead: str, directory: Path, free: int, pending: int = 0) -> LoadFailed:
    cache = directory.parent.parent  # <cache>/<name>/<version>
    others = f" (other fetches under way are still to write {_mib(pending)})" if pending else ""
    return LoadFailed(
        f"{lead} in the node cache ({cache}, THAW_CACHE_DIR), which has {_mib(free)} free"
        f"{others}:"
        " free space on that filesystem or point THAW_CACHE_DIR at a larger one",
        free_bytes=free,
    )


def discard(directory: Path) -> None:
    """Remove a version directory, and its bundle's directory if that is then empty."""
    shutil.rmtree(directory, ignore_errors=True)
    with contextlib.suppress(OSError):
        directory.parent.rmdir()


@contextlib.contextmanager
def filling(cache_dir: Path, manifest: Manifest) -> Iterator[None]:
    """Exclusive right to fill this version's directory, across processes. The lock
    file is removed on release (`_locked` sees to a waiter left with its inode)."""
    path = _fill_lock(cache_dir, manifest)
    fd = _locked(path, fcntl.LOCK_EX, os.O_RDWR)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def hold(directory: Path) -> int:
    """Make `directory` (a version's) if need be and hold it in use: a shared lock no
    `prune` removes it under. Returns the lock's descriptor; closing it lets go."""
    fd = _locked(directory / USE_LOCK, fcntl.LOCK_SH, os.O_RDONLY)
    with contextlib.suppress(OSError):  # when it was last held: `ensure_room`'s order
        os.utime(fd)
    return fd


def _locked(path: Path, operation: int, mode: int) -> int:
    """A descriptor of `path` (made, with its directory, if need be) under flock
    `operation`. After locking, the path must still name the locked file: one
    unlinked, or its directory removed, while we waited leaves us a stale inode,
    so we lock again."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, mode | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            continue  # its directory removed between the mkdir and the open
        try:
            fcntl.flock(fd, operation)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def prune(cache_dir: Path, manifest: Manifest) -> None:
    """Remove the versions of `manifest`'s bundle other than its own that no process
    holds, and what an interrupted removal left."""
    keep = version_dir(cache_dir, manifest)
    for version in _versions(keep.parent):
        if version != keep:
            _remove_unused(version)
    _clear_gone(keep.parent)


def _clear_gone(bundle_dir: Path) -> None:
    """Remove what removals killed midway left (renamed away: nobody uses it)."""
    for gone in bundle_dir.glob(f"{_GONE}*"):
        shutil.rmtree(gone, ignore_errors=True)


def _versions(bundle_dir: Path) -> list[Path]:
    """The version directories of one bundle (`<cache>/<name>`)."""
    with contextlib.suppress(OSError):
        return [
            Path(e.path)
            for e in os.scandir(bundle_dir)
            if _is_version(e.name) and e.is_dir(follow_symlinks=False)
        ]
    return []


def _bundle_dirs(cache_dir: Path) -> list[Path]:
    with contextlib.suppress(OSError):
        return [
            Path(e.path)
            for e in os.scandir(cache_dir)
            if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
        ]
    return []


def _all_versions(cache_dir: Path) -> list[Path]:
    return [version for bundle_dir in _bundle_dirs(cache_dir) for version in _versions(bundle_dir)]


def _is_version(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _last_held(version: Path) -> float:
    try:
        return (version / USE_LOCK).stat().st_mtime
    except OSError:
        return 0.0  # never held: a fetch killed before it locked, the first to go


def _remove_unused(version: Path) -> bool:
    """Remove a version directory unless a process holds it; True when removed."""
    try:
        fd = os.open(version / USE_LOCK, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False  # gone already, or not ours
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(version / USE_LOCK).st_ino != os.fstat(fd).st_ino:
                return False  # removed and made again while we waited: someone's now
        except (BlockingIOError, FileNotFoundError):
            return False
        gone = version.with_name(f"{_GONE}{version.name}-{os.getpid()}")
        try:
            os.rename(version, gone)
        except OSError:
            return False
        shutil.rmtree(gone, ignore_errors=True)
        return True
    finally:
        os.close(fd)

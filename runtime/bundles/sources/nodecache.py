"""The node cache: where a fetched bundle version lives, and whether it is complete.

    <cache>/<name>/<manifest sha256>/      the files, bundle.json, and last of all
                                           .thaw-fetched (the manifest id)
    <cache>/<name>.<manifest sha256>.lock  held while one process fills the directory

The directory is named by the manifest's hash, so a new version never collides
with the old one. The marker is written last, after every file was verified:
a directory whose marker names the manifest and whose files all have their
sizes is complete. The lock is an flock, so it is shared by every process on
the node (Lambda sandboxes reusing /tmp, containers sharing a volume) and is
released by the kernel if its holder dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from runtime.bundles.manifest import Manifest, write_manifest

MARKER = ".thaw-fetched"


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


def discard(directory: Path) -> None:
    """Remove a version directory, and its bundle's directory if that is then empty."""
    shutil.rmtree(directory, ignore_errors=True)
    with contextlib.suppress(OSError):
        directory.parent.rmdir()


@contextlib.contextmanager
def filling(cache_dir: Path, manifest: Manifest) -> Iterator[None]:
    """Exclusive right to fill this version's directory, across processes.

    The lock file is removed on release. After locking, the path must still
    name the locked file: a holder that released (and unlinked) it while we
    waited leaves us a stale inode, so we lock again.
    """
    path = cache_dir / f"{manifest.name}.{version_dir(cache_dir, manifest).name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)

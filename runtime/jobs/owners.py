"""Which job owners on this node are dead: one locked file per living instance.

A job's lease tells other nodes that its instance died only once it lapses
(`THAW_JOB_LEASE_S`, 30 s by default). On the node itself there is proof at
once: each instance holds an exclusive `flock` on `<state_dir>/owners/<id>.lock`
for its whole life, and the kernel drops the lock when the process ends, however
it ends (SIGKILL and OOM kills included). A lock file whose lock can be taken
belongs to a dead owner: its running jobs can be claimed at once (the store's
`claim_orphan`), and then the file is deleted.

A lock file is created under a temporary name, locked, and only then renamed
into place, so a `*.lock` file is never seen unlocked while its owner lives.
An unwritable state dir turns this off (logged once): jobs of a crashed
instance then wait for their leases, as those of other nodes always do.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("thaw.jobs")

_SUFFIX = ".lock"
_PENDING = ".pending"


def _file_name(owner: str) -> str:
    """A file name for `owner` (the file's content holds the id itself)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", owner)[:200] + _SUFFIX


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _names_this_file(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (not deleted or replaced)."""
    try:
        st, at = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (at.st_dev, at.st_ino)


@dataclass
class DeadOwner:
    """A dead owner's lock file, locked by this instance while it takes the jobs."""

    owner: str
    path: Path
    fd: int

    def release(self, *, delete: bool) -> None:
        """Delete the file (its jobs are taken care of) or leave it for a later try."""
        if delete:
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self.fd)


class OwnerLock:
    """This instance's lock file in `directory`, and the dead owners' beside it."""

    def __init__(self, directory: Path, owner: str) -> None:
        self.directory = directory
        self.owner = owner
        self.path = directory / _file_name(owner)
        self._fd: int | None = None
        self._warned = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def hold(self) -> bool:
        """Take this instance's lock (idempotent); False, logged once, if it cannot."""
        if self._fd is not None:
            return True
        attempts = 3
        for attempt in range(1, attempts + 1):
            try:
                self._fd = self._create()
                return True
            except OSError as exc:
                # FileNotFoundError: another instance removed the pending file in the
                # instant before it was locked (taking it for an abandoned one).
                if isinstance(exc, FileNotFoundError) and attempt < attempts:
                    continue
                self._warn(f"cannot hold {self.path}: {exc}")
        return False

    def _create(self) -> int:
        self.directory.mkdir(parents=True, exist_ok=True)
        pending = self.directory / f".{secrets.token_hex(8)}{_PENDING}"
        fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, self.owner.encode())
            os.replace(pending, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                pending.unlink()
            raise
        return fd

    def dead(self) -> list[DeadOwner]:
        """The dead owners' lock files, each now locked by this instance.

        Every file is checked before any is returned, so a caller that has
        handled them all has also seen every live owner's lock hold.
        """
        found: list[DeadOwner] = []
        try:
            entries = sorted(self.directory.iterdir())
        except FileNotFoundError:
            return found
        except OSError as exc:
            self._warn(f"cannot list {self.directory}: {exc}")
            return found
        for path in entries:
            if path == self.path:
                continue
            if path.name.endswith(_PENDING):
                self._remove_abandoned(path)
                continue
            if not path.name.endswith(_SUFFIX):
                continue
            dead = self._take(path)
            if dead is not None:
                found.append(dead)
        return found

    def _take(self, path: Path) -> DeadOwner | None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None  # deleted meanwhile (another instance took it), or unreadable
        try:
            # Locked: its owner lives. Unlinked or replaced: another instance took it.
            if not _try_lock(fd) or not _names_this_file(path, fd):
                os.close(fd)
                return None
            owner = os.pread(fd, 4096, 0).decode(errors="replace")
        except OSError:
            os.close(fd)
            return None
        if not owner:  # never written: its creator died before renaming it, so no jobs
            DeadOwner(owner, path, fd).release(delete=True)
            return None
        return DeadOwner(owner, path, fd)

    @staticmethod
    def _remove_abandoned(path: Path) -> None:
        """A pending file whose lock can be taken: its creator died before renaming it."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return
        try:
            if _try_lock(fd) and _names_this_file(path, fd):
                path.unlink()
        except OSError:
            pass
        finally:
            os.close(fd)

    def release(self, *, delete: bool = True) -> None:
        """Let go of this instance's lock; `delete` when it leaves no running job behind."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if delete:
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(fd)

    def _warn(self, detail: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "dead-owner recovery is off (%s): jobs of an instance that dies here are"
                " retried when their leases lapse",
                detail,
            )

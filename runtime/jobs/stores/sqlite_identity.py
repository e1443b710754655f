"""Which file a path, or a descriptor, names: how the SQLite store tells that the
database it writes is still the one at its path (runtime/jobs/stores/sqlite_file.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

MAGIC = b"SQLite format 3\x00"

# A file as the kernel knows it: (st_dev, st_ino).
Identity = tuple[int, int]


def identity_of(path: str | Path) -> Identity | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def identity_of_fd(fd: int) -> Identity | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def descriptors_of(identity: Identity) -> Iterator[int]:
    """This process's open descriptors on the file `identity` (Linux: /proc); lazily."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        if name.isdigit() and identity_of_fd(int(name)) == identity:
            yield int(name)


def header_of(identity: Identity | None, known_fd: int | None) -> tuple[bytes | None, int | None]:
    """The first bytes of the database file `identity`, read through a descriptor
    SQLite already holds on it (`known_fd` first, the one found last time), and that
    descriptor; (None, None) where there is no way to tell.

    Never through a descriptor of our own: closing any descriptor of a file
    drops every POSIX lock this process holds on it, SQLite's included (the
    lock that tells other processes this database is in use). Without it, the
    last other connection to close deletes the -wal still being written here.
    """
    if identity is None:
        return None, None
    if known_fd is not None:
        head = _header_through(known_fd, identity)
        if head is not None:
            return head, known_fd
    for fd in descriptors_of(identity):  # scanned only on a miss
        head = _header_through(fd, identity)
        if head is not None:
            return head, fd
    return None, None


def _header_through(fd: int, identity: Identity) -> bytes | None:
    """The file's first bytes read through `fd`, if `fd` is on the file `identity`.

    Read first, then checked (one fstat, not one before and one after): a descriptor
    closed and reused for another file before the read still names that file after
    it, and such a read is thrown away. pread needs a seekable file, so a descriptor
    reused for a socket or a pipe fails at once (ESPIPE) rather than wait."""
    try:
        head = os.pread(fd, len(MAGIC), 0)
    except OSError:  # closed meanwhile, or a descriptor that cannot be read
        return None
    if identity_of_fd(fd) != identity:
        return None
    return head

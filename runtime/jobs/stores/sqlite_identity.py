"""Which file a path, or a descriptor, names: how the SQLite store tells that the
database it writes is still the one at its path (runtime/jobs/stores/sqlite_file.py).
"""

from __future__ import annotations

import itertools
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
    known = [] if known_fd is None else [known_fd]
    for fd in itertools.chain(known, descriptors_of(identity)):  # scans only on a miss
        if identity_of_fd(fd) != identity:
            continue
        head = os.pread(fd, len(MAGIC), 0)
        if identity_of_fd(fd) == identity:  # not closed and reused meanwhile
            return head, fd
    return None, None

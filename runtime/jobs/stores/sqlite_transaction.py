"""The pieces of one SQLite store call (runtime/jobs/stores/sqlite_file.py): its
write transaction, and the translation of its faults into `StorageUnavailable`.

They are classes, not @contextmanager generators: they wrap every store call,
twice for a call run now on the loop, and a generator's machinery (its frame,
and six calls per use against a class's three) was paid on each (issue 29).
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Protocol

from runtime.errors import StorageUnavailable


class Wait(Exception):
    """A call run now would have to wait (a lock, a file to reopen): NOT_NOW."""


# SQLite's result codes for a lock held elsewhere (its extended codes keep them in the low byte).
BUSY_CODES = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED


class File(Protocol):
    """What a call needs of the file it runs on (`SQLiteFile`)."""

    def calling_now(self) -> bool:
        """Whether this thread is in a call run now (busy is then `Wait`, not a fault)."""
        ...

    def unavailable(self, what: str, exc: sqlite3.Error | OSError) -> StorageUnavailable: ...

    def writing_now(self) -> sqlite3.Connection:
        """The connection of the call run now, in its transaction (else `Wait`)."""
        ...


class Committed:
    """BEGIN IMMEDIATE ... COMMIT on `conn`, rolled back if the block or the COMMIT fails."""

    __slots__ = ("conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        conn = self.conn
        if kind is None:
            try:
                conn.execute("COMMIT")
                return
            except BaseException:
                _roll_back(conn)
                raise
        _roll_back(conn)


def _roll_back(conn: sqlite3.Connection) -> None:
    # A failed COMMIT (a full disk) leaves the transaction open; a failed
    # statement may have rolled it back already.
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


class Translated:
    """sqlite3 and OS errors raised in the block -> StorageUnavailable, naming `what`."""

    __slots__ = ("file", "what")

    def __init__(self, file: File, what: str) -> None:
        self.file = file
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None or isinstance(exc, sqlite3.ProgrammingError | sqlite3.InterfaceError):
            return  # none, or misuse of the API: a bug here, not the storage
        file = self.file
        if isinstance(exc, sqlite3.OperationalError):
            if file.calling_now() and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in BUSY_CODES:
                raise Wait() from exc  # locked elsewhere: a thread waits for it instead
            raise file.unavailable(self.what, exc) from exc
        if isinstance(exc, sqlite3.Error | OSError):
            raise file.unavailable(self.what, exc) from exc


class InCallNow(Translated):
    """A write transaction inside a call run now: that call's own, translated."""

    __slots__ = ()

    def __enter__(self) -> sqlite3.Connection:  # type: ignore[override]
        return self.file.writing_now()

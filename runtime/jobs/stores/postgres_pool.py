"""Connections of the PostgreSQL job store: the URL, a small pool, errors translated once.

The URL is libpq's (`postgresql://user:password@host:port/db?sslmode=...`) plus
Thaw's own query parameters, taken out before libpq sees it:

- `pool_max` (default 8): connections this instance keeps for store calls.
- `prepare=1`: let psycopg prepare the statements it runs often (from the
  fifth run on). Only straight to PostgreSQL, or to a pooler that keeps
  prepared statements (PgBouncer 1.21+ with `max_prepared_statements`): in
  transaction mode a statement prepared on one server connection is missing on
  the next. Off by default; it saves the planning of each claim (docs/fleet.md).
- `listen`: where the listening session goes (`LISTEN` needs a session of its
  own, which a pooler in transaction mode cannot give), percent-encoded where it
  holds a `&`; by default the URL itself. With PgBouncer in front, the URL names
  PgBouncer and `listen` names PostgreSQL (docs/fleet.md).

Every connection is in autocommit mode and every store call is one statement
(one round trip, one implicit transaction), and unless `prepare=1` no statement
is prepared on the server (`prepare_threshold=None`): PgBouncer in transaction
mode hands each transaction to any server connection, where a statement
prepared by another would be missing.

Why not psycopg_pool: it connects in background workers, so a client waiting
for a connection to a server that is down learns only "couldn't get a
connection after 30 s", never "connection refused", and its reconnect back-off
doubles without bound, so after an outage of T seconds the pool may take T
more to notice the server is back. Here a call that needs a connection makes
it itself (a refusal is a `StorageUnavailable` at once, with libpq's reason),
and the first call after the server returns connects. An idle connection the
server closed (a restart) is noticed before use and replaced (`_quiet`); one
that breaks during a call fails that call and drops every idle one too.
"""

from __future__ import annotations

import contextlib
import select
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus

from runtime.errors import ConfigError, StorageUnavailable
from runtime.jobs.job import STORE_RETRY_AFTER_S

Connection = psycopg.Connection[tuple[Any, ...]]

_SCHEMES = ("postgresql://", "postgres://")
# libpq settings Thaw adds unless the URL sets them: a server that does not
# answer is a quick 503, not a call stuck for minutes, and a peer gone silent
# (a partition, a dead host) is noticed within about 20 s.
_DEFAULTS = {
    "connect_timeout": "5",
    "application_name": "thaw",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "2",
}
# An idle connection unused this long is closed (a quiet instance holds one at most).
_IDLE_S = 60.0
# How long a call waits for one of the `pool_max` connections before a 503.
_WAIT_S = 10.0


@dataclass(frozen=True)
class Target:
    """Where the store's connections go, parsed from THAW_JOB_STORE."""

    conninfo: str
    listen_conninfo: str
    pool_max: int
    prepare: bool
    # host:port/db, for messages (never the password).
    where: str


def _libpq(url: str, what: str) -> tuple[str, str]:
    """(conninfo with Thaw's defaults, host:port/db); ConfigError if libpq refuses it."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"THAW_JOB_STORE: {what} is not a valid PostgreSQL URL: {exc}") from exc
    port = str(params.get("port", "5432"))
    if not all(part.isdigit() for part in port.split(",")):
        # libpq would accept it here and fail every connection attempt instead.
        raise ConfigError(f"THAW_JOB_STORE: {what} has a port that is not a number: {port!r}")
    for key, value in _DEFAULTS.items():
        params.setdefault(key, value)
    where = (
        f"{params.get('host', 'localhost')}:{params.get('port', 5432)}/{params.get('dbname', '')}"
    )
    return make_conninfo("", **params), where


def _redacted(url: str) -> str:
    """The URL as a message may show it: without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(
        parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    )


def parse_url(url: str) -> Target:
    if not url.startswith(_SCHEMES):
        raise ConfigError(
            f"THAW_JOB_STORE={_redacted(url)!r}: expected postgresql://user@host:port/db"
        )
    parts = urlsplit(url)
    ours: dict[str, str] = {}
    theirs: list[tuple[str, str]] = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in ("pool_max", "listen", "prepare"):
            ours[key] = value
        else:
            theirs.append((key, value))
    libpq_url = urlunsplit(parts._replace(query=urlencode(theirs)))
    conninfo, where = _libpq(libpq_url, "the URL")
    listen = ours.get("listen")
    listen_conninfo = conninfo if listen is None else _libpq(listen, "?listen=")[0]
    try:
        pool_max = int(ours.get("pool_max", "8"))
    except ValueError:
        pool_max = 0
    if pool_max < 1:
        raise ConfigError(
            f"THAW_JOB_STORE: pool_max must be a whole number >= 1, got {ours['pool_max']!r}"
        )
    prepare = ours.get("prepare", "0")
    if prepare not in ("0", "1"):
        raise ConfigError(f"THAW_JOB_STORE: prepare must be 0 or 1, got {prepare!r}")
    return Target(conninfo, listen_conninfo, pool_max, prepare == "1", where)


def connect(conninfo: str, prepare: bool = False) -> Connection:
    # psycopg's own default threshold (5 runs) when asked, else never.
    return psycopg.connect(conninfo, autocommit=True, prepare_threshold=5 if prepare else None)


@contextlib.contextmanager
def translated(where: str, what: str) -> Iterator[None]:
    """psycopg's server and connection errors -> StorageUnavailable, once, at the boundary.

    OperationalError covers a refused or lost connection, a server shutting
    down or starting up, a full disk and a cancelled statement; InternalError
    a read-only server (a standby after a failover). ProgrammingError and the
    like are bugs here, and stay what they are.
    """
    try:
        yield
    except (psycopg.OperationalError, psycopg.InternalError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StorageUnavailable(
            f"job store {where}: {what} failed: {reason}", retry_after_s=STORE_RETRY_AFTER_S
        ) from exc


def _quiet(conn: Connection) -> bool:
    """Whether an idle connection is still usable, without a round trip.

    The server says nothing on an idle connection unless it is closing it (a
    shutdown, a restart, a crash, an idle timeout): a readable socket means it
    is gone. Checked before a statement is sent on it, so the first call after
    a restart connects afresh instead of failing, and nothing sent is in doubt.
    """
    try:
        ready, _, _ = select.select([conn.fileno()], [], [], 0)
    except (psycopg.Error, OSError, ValueError):
        return False
    return not ready


class Pool:
    """Up to `size` autocommit connections, made by the calls that need them."""

    def __init__(self, conninfo: str, size: int, where: str, *, prepare: bool = False) -> None:
        self.conninfo = conninfo
        self.prepare = prepare
        self.where = where
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        # (connection, when it was put back), most recently used last.
        self._idle: deque[tuple[Connection, float]] = deque()
        self._closed = False

    @contextlib.contextmanager
    def connection(self) -> Iterator[Connection]:
        """A connection for one call; psycopg errors pass through (callers translate)."""
        if not self._slots.acquire(timeout=_WAIT_S):
            raise StorageUnavailable(
                f"job store {self.where}: all connections stayed busy for {_WAIT_S:.0f} s",
                retry_after_s=STORE_RETRY_AFTER_S,
            )
        conn: Connection | None = None
        try:
            conn = self._take()
            yield conn
        except BaseException:
            if conn is not None and conn.closed:
                self._drop_idle()
            raise
        finally:
            if conn is not None:
                self._give_back(conn)
            self._slots.release()

    def _take(self) -> Connection:
        now = time.monotonic()
        unusable: list[Connection] = []
        conn: Connection | None = None
        with self._lock:
            # The least recently used go first: a quiet instance shrinks to one.
            while self._idle and now - self._idle[0][1] > _IDLE_S:
                unusable.append(self._idle.popleft()[0])
            while self._idle and conn is None:
                conn = self._idle.pop()[0]
                if not _quiet(conn):
                    unusable.append(conn)
                    conn = None
        for old in unusable:
            old.close()
        return conn if conn is not None else connect(self.conninfo, self.prepare)

    def _give_back(self, conn: Connection) -> None:
        if conn.closed or conn.info.transaction_status != TransactionStatus.IDLE:
            conn.close()
            return
        with self._lock:
            if not self._closed:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = list(self._idle), deque()
        for conn, _ in idle:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._drop_idle()

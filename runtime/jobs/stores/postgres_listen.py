"""Wake-ups from PostgreSQL itself: one listening session per instance.

Every store write that changes what a waiter waits for (a job created,
claimed, moved to a phase, finished, cancelled, failed as lost) calls
`pg_notify('thaw_jobs', '<id> <status> <handler>')` in its own statement, so
the notification is sent if and only if the write commits, and through
PgBouncer too (NOTIFY is an ordinary statement; only LISTEN needs a session).

A `Listener` holds the one session that LISTENs, straight to PostgreSQL, in
a thread of its own that sleeps in `select()` on the socket (no polling of the
table). It calls `on_event(JobEvent)` for each notification, in the order the
server committed them, from that thread: an asyncio consumer hands them to its
loop with `call_soon_threadsafe`. Notifications sent while the session is
not listening are lost, so each time LISTEN takes effect it calls `on_gap()`:
whatever a consumer waits for may have changed meanwhile, and it should read it
again. The first time too: a job this instance took before its session listened
(a submit can beat the connect) may have been cancelled elsewhere in between.
The session is checked every `keepalive_s` with a `SELECT 1`, so a server gone
silent is noticed, and reconnected with a back-off of up to 2 s.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
from collections.abc import Callable
from typing import NamedTuple

import psycopg

from runtime.jobs.stores.postgres_pool import Connection, connect

log = logging.getLogger("thaw.jobs")

CHANNEL = "thaw_jobs"
_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class JobEvent(NamedTuple):
    """A committed change of one job, as a notification tells it."""

    job_id: str
    status: str
    handler: str

    @classmethod
    def parse(cls, payload: str) -> JobEvent | None:
        # Job ids and statuses hold no space; a handler name is the rest.
        parts = payload.split(" ", 2)
        return cls(*parts) if len(parts) == 3 else None


class Listener:
    """The instance's listening session; `start()` it, `stop()` it."""

    def __init__(
        self,
        conninfo: str,
        where: str,
        on_event: Callable[[JobEvent], None],
        on_gap: Callable[[], None] = lambda: None,
        *,
        keepalive_s: float = 10.0,
    ) -> None:
        self.conninfo = conninfo
        self.where = where
        self.on_event = on_event
        self.on_gap = on_gap
        self.keepalive_s = keepalive_s
        # Set while LISTEN is in effect (tests and readiness may wait on it).
        self.listening = threading.Event()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="thaw-pg-listen", daemon=True)

    def start(self) -> Listener:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            conn: Connection | None = None
            try:
                conn = connect(self.conninfo)
                conn.execute(f"LISTEN {CHANNEL}")
                self.listening.set()
                if failures:
                    log.info("job store %s: listening for job changes again", self.where)
                failures = 0
                self._call(self.on_gap)
                self._serve(conn)
            except psycopg.Error as exc:
                if not self._stop.is_set():
                    if failures == 0:
                        log.warning(
                            "job store %s: the listening session failed (%s); reconnecting",
                            self.where,
                            str(exc).strip().splitlines()[0] if str(exc).strip() else exc,
                        )
                    self._stop.wait(_BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)])
                    failures += 1
            finally:
                self.listening.clear()
                if conn is not None:
                    conn.close()

    def _call(self, callback: Callable[..., None], *args: JobEvent) -> None:
        """A consumer's callback; what it raises is logged, and listening goes on."""
        try:
            callback(*args)
        except Exception:
            log.exception("job store %s: a job-change callback failed", self.where)

    def _serve(self, conn: Connection) -> None:
        """Deliver notifications until stopped or the session fails (psycopg.Error)."""
        session, wake = conn.fileno(), self._wake_r.fileno()
        while not self._stop.is_set():
            ready, _, _ = select.select([session, wake], [], [], self.keepalive_s)
            if wake in ready:
                return
            if not ready:
                conn.execute("SELECT 1")  # the session still answers, or this raises
            # timeout=0: read what arrived, never wait (select did the waiting).
            for notify in conn.notifies(timeout=0):
                event = JobEvent.parse(notify.payload)
                if event is not None:
                    self._call(self.on_event, event)

"""Logging as JSON lines: one object per event, never request bodies or secrets.

Fields: ts, level, logger, msg, and any of request_id, handler, bundle, phase,
duration_ms, job_id, status, method, route, traceback passed through `extra=`.
Message arguments are formatted by us, so the only way a payload reaches a log line is
a deliberate `%s` of it, which the runtime never does.

`request_id` is also taken from `REQUEST_ID`, a context variable the app sets
for each request (runtime.http.edge.Edge) and the job manager for each job it
runs: every line logged while a request or its job is served names it, the
runtime's own lines and a handler's alike (handler threads and tasks run in a
copy of the request's context). One `extra=` of its own wins.

The access log (`thaw.access`, one line per answered request) is written after
the answer, not on its path: `DEFERRED_LOGS.add` keeps the line's fields (its time
stamped then) and the lines are written together, in the order they were
kept, FLUSH_AFTER_S after the first of them (or at once when FLUSH_LINES are
pending), in one write to the stream when our JSON handler is where they go
(`JSONLines`), else each through its logger as any record. A write per loop
turn was a sizeable share of a lone client's warm request (the write is a
system call on the answer's path); a write per window costs a few per second.
Other info lines about an event that is over, and that a request or job waits
on (a job's outcome, once recorded: `DEFERRED_LOGS.info`), are kept with them
the same way: written at once, each would hold up the answer it follows.
Pending lines are written at exit and when the server stops (`DEFERRED_LOGS.flush`),
so a stopped server has logged every request it answered; what a SIGKILL
loses is the last window's lines.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
from contextvars import ContextVar
from typing import Any

import orjson

from runtime.clock import SYSTEM, Clock, Timer, utc_second

_EXTRA_FIELDS = (
    "handler",
    "bundle",
    "phase",
    "duration_ms",
    "job_id",
    "status",
    "method",
    "route",
    "status_code",
    # User code's traceback (runtime/wire/render.py's user_traceback): on the one
    # ERROR record of a handler's or builder's exception.
    "traceback",
)

# The request (or job) being served in this context; None outside any.
REQUEST_ID: ContextVar[str | None] = ContextVar("thaw_request_id", default=None)


def _stamp(created: float) -> str:
    """`created` (epoch seconds) as the line's ts: UTC, milliseconds, as LogRecord rounds."""
    whole = int(created)
    millis = int((created - whole) * 1000)  # LogRecord.msecs
    return f"{utc_second(whole)}.{millis:03d}Z"


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _stamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        for name in _EXTRA_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info and record.exc_info[0] is not None:
            entry["exc_type"] = record.exc_info[0].__name__
        return orjson.dumps(entry, default=str).decode()


class JSONLines(logging.StreamHandler):  # type: ignore[type-arg]
    """The runtime's handler: JSON lines (`JSONFormatter`) to a stream."""


# One request's access-log line, as kept until written:
# (created, method, route template, status, duration ms, request id).
AccessEntry = tuple[float, str, str, int, float, str | None]

access_log = logging.getLogger("thaw.access")


class DeferredLine:
    """An info line of another logger, kept until written with the access lines:
    its time and request id taken when it was kept, its fields `_EXTRA_FIELDS`."""

    __slots__ = ("created", "fields", "logger", "msg", "request_id")

    def __init__(
        self,
        created: float,
        logger: logging.Logger,
        msg: str,
        request_id: str | None,
        fields: dict[str, Any],
    ) -> None:
        self.created = created
        self.logger = logger
        self.msg = msg
        self.request_id = request_id
        self.fields = fields


# How long a line may wait to be written with the lines after it, and how many
# may wait: a window short enough to read the log live, long enough to write a
# busy second's lines in tens of writes, not thousands.
FLUSH_AFTER_S = 0.05
FLUSH_LINES = 512


class DeferredLines:
    """The lines kept to be written after their answers (see the module docstring).

    Its window's timer runs on `clock`; an access line's time is its caller's
    (`Edge` reads the instance's wall clock), another line's is `clock.wall()`."""

    __slots__ = ("_loop", "_pending", "_timer", "clock", "flush_after_s", "flush_lines")

    def __init__(
        self,
        flush_after_s: float = FLUSH_AFTER_S,
        flush_lines: int = FLUSH_LINES,
        clock: Clock = SYSTEM,
    ) -> None:
        self.clock = clock
        self._pending: list[AccessEntry | DeferredLine] = []
        self._timer: Timer | None = None
        # The loop the open window's timer runs on; None: no window open.
        self._loop: asyncio.AbstractEventLoop | None = None
        self.flush_after_s = flush_after_s
        self.flush_lines = flush_lines

    def add(
        self, method: str, route: str, status: int, took_s: float, request_id: str, at: float
    ) -> None:
        """One answered request's access line (status 0: it ended with no answer, cut
        off), answered at `at` (epoch seconds). Whether the logger takes INFO lines is
        asked as they are written, not once per request."""
        took_ms = round(took_s * 1000, 3)
        self._keep((at, method[:16], route, status, took_ms, request_id))

    def info(self, logger: logging.Logger, msg: str, **fields: Any) -> None:
        """An info line of `logger` whose event is over (a job's outcome, recorded), kept
        as an access line is: `msg` formatted already, `fields` among `_EXTRA_FIELDS`,
        the request id the context's now."""
        self._keep(DeferredLine(self.clock.wall(), logger, msg, REQUEST_ID.get(), fields))

    def _keep(self, entry: AccessEntry | DeferredLine) -> None:
        """Written `flush_after_s` later with the lines kept meanwhile (at once outside
        a running loop, or when `flush_lines` are pending)."""
        pending = self._pending
        pending.append(entry)
        if len(pending) >= self.flush_lines:
            self.flush()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        if self._loop is not loop:
            # No window open here: none yet, or one whose loop ended before its timer.
            self._loop = loop
            self._timer = self.clock.call_later(self.flush_after_s, self.flush)

    def flush(self) -> None:
        """Write every pending line now, in order."""
        timer, self._timer, self._loop = self._timer, None, None
        if timer is not None:
            timer.cancel()  # a no-op when it is the timer calling
        pending, self._pending = self._pending, []
        if not pending:
            return
        loggers = {access_log} | {e.logger for e in pending if isinstance(e, DeferredLine)}
        taken = {logger for logger in loggers if logger.isEnabledFor(logging.INFO)}
        if not taken:
            return
        handler = _direct_handler(taken)
        if handler is None:
            # Each line names the request it was kept under, or none: never the one
            # being served where the flush runs (JSONFormatter's fallback).
            token = REQUEST_ID.set(None)
            try:
                for entry in pending:
                    if _logger_of(entry) in taken:
                        _logger_of(entry).handle(_record(entry))
            finally:
                REQUEST_ID.reset(token)
            return
        terminator = handler.terminator
        text = "".join(
            [_line(entry) + terminator for entry in pending if _logger_of(entry) in taken]
        )
        handler.acquire()
        try:
            handler.stream.write(text)
            handler.flush()
        except Exception:  # as StreamHandler.emit: reported, never raised into the caller
            handler.handleError(_record(pending[0]))
        finally:
            handler.release()


def _logger_of(entry: AccessEntry | DeferredLine) -> logging.Logger:
    return access_log if isinstance(entry, tuple) else entry.logger


def _direct_handler(loggers: set[logging.Logger]) -> JSONLines | None:
    """Our JSON handler when it alone takes these loggers' lines (no filter, no other
    handler on the way): then a batch is written as one string; else None."""
    for logger in loggers:
        if logger.handlers or logger.filters or not logger.propagate:
            return None
        parent = logger.parent
        while parent is not None and parent.parent is not None:  # up to the root
            if parent.handlers or parent.filters or not parent.propagate:
                return None
            parent = parent.parent
    root = logging.getLogger()
    if root.filters or len(root.handlers) != 1:
        return None
    handler = root.handlers[0]
    if type(handler) is not JSONLines or handler.filters or handler.level > logging.INFO:
        return None
    if type(handler.formatter) is not JSONFormatter:
        return None
    return handler


def _message(entry: AccessEntry) -> str:
    _, method, route, status, took_ms, _ = entry
    return "%s %s %d %.1f ms" % (method, route, status, took_ms)  # noqa: UP031  # the logged form


def _line(entry: AccessEntry | DeferredLine) -> str:
    """The JSON line `JSONFormatter` writes for `_record(entry)`, field for field."""
    if not isinstance(entry, tuple):
        later: dict[str, Any] = {
            "ts": _stamp(entry.created),
            "level": "info",
            "logger": entry.logger.name,
            "msg": entry.msg,
        }
        if entry.request_id is not None:
            later["request_id"] = entry.request_id
        fields = entry.fields
        for name in _EXTRA_FIELDS:
            value = fields.get(name)
            if value is not None:
                later[name] = value
        return orjson.dumps(later, default=str).decode()
    created, method, route, status, took_ms, request_id = entry
    line: dict[str, Any] = {
        "ts": _stamp(created),
        "level": "info",
        "logger": access_log.name,
        "msg": _message(entry),
    }
    if request_id is not None:
        line["request_id"] = request_id
    # In _EXTRA_FIELDS' order.
    line["duration_ms"] = took_ms
    line["method"] = method
    line["route"] = route
    line["status_code"] = status
    return orjson.dumps(line).decode()


def _record(entry: AccessEntry | DeferredLine) -> logging.LogRecord:
    if isinstance(entry, tuple):
        created, method, route, status, took_ms, request_id = entry
        logger, msg = access_log, _message(entry)
        extra: dict[str, Any] = {
            "method": method,
            "route": route,
            "status_code": status,
            "duration_ms": took_ms,
            "request_id": request_id,
        }
    else:
        created, logger, msg = entry.created, entry.logger, entry.msg
        extra = {**entry.fields, "request_id": entry.request_id}
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, msg, (), None, extra=extra)
    record.created = created
    record.msecs = int((created - int(created)) * 1000) + 0.0
    return record


DEFERRED_LOGS = DeferredLines()
# At exit (after the loop stopped): lines still pending are written before logging shuts down.
atexit.register(DEFERRED_LOGS.flush)


def configure_logging(level: str = "INFO") -> None:
    handler = JSONLines(sys.stderr)
    handler.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn installs its own handlers; route them through ours.
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True

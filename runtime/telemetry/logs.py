"""Logging as JSON lines: one object per event, never request bodies or secrets.

Fields: ts, level, logger, msg, and any of request_id, handler, bundle, phase,
duration_ms, job_id, status, method, route passed through `extra=`. Message
arguments are formatted by us, so the only way a payload reaches a log line is
a deliberate `%s` of it, which the runtime never does.

`request_id` is also taken from `REQUEST_ID`, a context variable the app sets
for each request (runtime.http.edge.Edge) and the job manager for each job it
runs: every line logged while a request or its job is served names it, the
runtime's own lines and a handler's alike (handler threads and tasks run in a
copy of the request's context). One `extra=` of its own wins.
"""

from __future__ import annotations

import logging
import sys
import time
from contextvars import ContextVar
from typing import Any

import orjson

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
)

# The request (or job) being served in this context; None outside any.
REQUEST_ID: ContextVar[str | None] = ContextVar("thaw_request_id", default=None)


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
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


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn installs its own handlers; route them through ours.
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True

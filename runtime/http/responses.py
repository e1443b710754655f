"""The JSON answers routes give: a body (`JSONResponse`), a job (`job_response`),
and the Server-Timing value of an invocation (`server_timing`)."""

from __future__ import annotations

import math
from typing import Any

import orjson
from starlette.responses import Response

from runtime.jobs.job import Job

_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=_JSON_OPTS)


class OutputResponse(Response):
    """A handler's output answered (200): its JSON bytes and its Server-Timing.

    The header list is built here as is, not through Starlette's `init_headers`
    (which lowercases and encodes a mapping, then scans it for the two headers it
    adds): this is every warm invocation's answer (issue 29)."""

    media_type = "application/json"

    def __init__(self, body: bytes, timing: str) -> None:
        self.status_code = 200
        self.background = None
        self.body = body
        self.raw_headers = [
            (b"server-timing", timing.encode("latin-1")),
            (b"content-length", b"%d" % len(body)),
            (b"content-type", b"application/json"),
        ]


class JSONBody(Response):
    """`content` as JSON, its header list built here as is (as `OutputResponse`'s):
    a job's 202 and its polls, the durable job cycle's two answers (issue 29).
    `headers`: raw (lowercase name, value) pairs sent before the body's own."""

    media_type = "application/json"

    def __init__(
        self,
        content: Any,
        status_code: int = 200,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.status_code = status_code
        self.background = None
        self.body = body = orjson.dumps(content, option=_JSON_OPTS)
        raw = headers if headers is not None else []
        raw.append((b"content-length", b"%d" % len(body)))
        raw.append((b"content-type", b"application/json"))
        self.raw_headers = raw


def server_timing(timings_ms: dict[str, float], batch_size: int | None = None) -> str:
    """The Server-Timing value; the dispatcher fills `timings_ms` in phase order.
    A batched request's `batch` (its wait for the batch) says the batch's size."""
    parts = []
    for name, ms in timings_ms.items():
        if name == "batch" and batch_size is not None:
            parts.append('%s;dur=%.3f;desc="n=%d"' % (name, ms, batch_size))  # noqa: UP031
        else:
            parts.append("%s;dur=%.3f" % (name, ms))  # noqa: UP031  # a loop, no comprehension frame
    return ", ".join(parts)


def job_response(
    job: Job,
    status: int = 200,
    retry_after_s: float | None = None,
    *,
    applied: str | None = None,
) -> Response:
    headers = [(b"location", b"/jobs/" + job.id.encode())]
    if retry_after_s is not None:
        # A job final already (its work ended before this answer) holds its result
        # here: nothing to wait for, where a whole second would be the hint otherwise.
        after = 0 if job.status.final else max(1, math.ceil(retry_after_s))
        headers.append((b"retry-after", b"%d" % after))
    if applied is not None:
        # RFC 7240: only preferences the client sent and the server honoured.
        headers.append((b"preference-applied", applied.encode("latin-1")))
    return JSONBody(job.public(), status, headers)

"""Jobs: submitting one (`POST /handlers/{handler}/jobs`, and the deprecated
`POST /jobs/{handler}`), reading one (`?wait=S` long-polls; `Accept:
text/event-stream` follows it), and cancelling one.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import aclosing
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import Scope

from runtime.errors import BadRequest, ThawError
from runtime.http import sse
from runtime.http.auth import key_id_of
from runtime.http.edge import PICKED_SCOPE
from runtime.http.holds import Holds
from runtime.http.responses import JSONBody
from runtime.http.routes import instance_of
from runtime.http.routes.invoke import invocation
from runtime.http.routing import Endpoint


async def submit_job(request: Request) -> Response | sse.EventStreamResponse:
    """Submit a job: invoke a handler asynchronously; always 202 with the job."""
    return await invocation(request, force_async=True)


# RFC 9745: the date `POST /jobs/{handler}` was deprecated (2026-12-01), as @epoch-seconds.
_DEPRECATED = "@1796083200"


async def submit_job_deprecated(request: Request) -> Response:
    """`POST /jobs/{handler}`: the submit route before `POST /handlers/{handler}/jobs`."""
    response = await invocation(request, force_async=True)
    assert isinstance(response, Response)  # a submit never streams
    successor = f"/handlers/{quote(request.path_params['handler'], safe='')}/jobs"
    response.headers["Deprecation"] = _DEPRECATED
    response.headers["Link"] = f'<{successor}>; rel="successor-version"'
    return response


class DeprecatedSubmitRoute(Endpoint):
    """The route of `submit_job_deprecated`: only where `{handler}` names a handler.

    `POST /jobs/{handler}` and `GET|DELETE /jobs/{job_id}` differ only in the
    name of their template's variable, which OpenAPI 3.1 forbids: the alias is
    left out of the document, and matches only a registered handler's name (a
    job id, 22 random characters, is none). Any other `POST /jobs/{x}` is 405
    with `Allow: DELETE, GET, HEAD`, as the document says.
    """

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is Match.NONE:
            return match, child
        app = scope.get("app")
        instance = getattr(getattr(app, "state", None), "instance", None)
        if instance is None or not instance.serves(child["path_params"]["handler"]):
            return Match.NONE, {}
        return match, child


def _wait_param(request: Request, max_wait_s: float) -> float:
    raw = _plain_query_value(request.scope["query_string"], b"wait")
    if raw is None:
        raw = request.query_params.get("wait", "0")
    try:
        wait_s = float(raw)
    except ValueError:
        raise BadRequest(f"wait={raw!r} is not a number of seconds") from None
    if not math.isfinite(wait_s) or wait_s < 0:
        raise BadRequest(f"wait={raw!r} must be a non-negative number of seconds")
    return min(wait_s, max_wait_s)


def _plain_query_value(query: bytes, name: bytes) -> str | None:
    """`name`'s last value in a query string that escapes nothing (no % nor +), read
    as Starlette's `query_params` reads it ("0" when absent); None for any other
    query string, which `query_params` decodes. A poll's `?wait=5` costs a split,
    where `query_params` builds a multi-dict of the decoded pairs."""
    if b"%" in query or b"+" in query:
        return None
    found = b"0"
    for pair in query.split(b"&"):
        key, _, value = pair.partition(b"=")
        if key == name:
            found = value
    return found.decode("latin-1")


async def get_job(request: Request) -> Response | sse.EventStreamResponse:
    """The job object; `?wait=S` long-polls up to S seconds for a final state. A running
    stream's job shows its output so far; `Accept: text/event-stream` follows it."""
    instance = instance_of(request)
    accept = request.scope[PICKED_SCOPE].get(b"accept")  # picked by the edge: no scan
    if accept is not None and sse.wants_events(accept.decode("latin-1")):
        return await follow_job(request)
    job_id = request.path_params["job_id"]
    key_id = key_id_of(request)
    wait_s = _wait_param(request, instance.settings.max_wait_s)
    if wait_s <= 0:
        return JSONBody(await instance.job_view(job_id, key_id=key_id))
    holds: Holds = request.app.state.holds
    holds.take(key_id)  # a long-poll holds its connection
    try:
        body = await instance.job_view(job_id, key_id=key_id, wait_s=wait_s)
    finally:
        holds.give(key_id)
    return JSONBody(body)


# Past any stream's items, and within a store's BIGINT: where a resume from a larger
# id starts (only the end is left to send).
_MAX_EVENT_INDEX = 2**62


def resume_index(raw: str | None) -> int:
    """The item a follower resumes at: the one after `Last-Event-ID` (0 without one).

    The ids Thaw sends are item indexes, so anything else (negative, a fraction,
    words, bytes that are not ASCII digits) was never one of its ids: 400,
    never a 5xx; an id past every item resumes at the end.
    """
    text = (raw or "").strip(" \t")
    if not text:
        return 0
    if not (text.isascii() and text.isdigit()):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise BadRequest(
            f"Last-Event-ID {shown!r} is not the id of an event of this stream "
            "(ids are item indexes: 0, 1, 2, ...)"
        )
    digits = text.lstrip("0") or "0"
    if len(digits) > 18:  # int() of a huge string is slow, and refused past 4300 digits
        return _MAX_EVENT_INDEX + 1
    return min(int(digits), _MAX_EVENT_INDEX) + 1


async def follow_job(request: Request) -> sse.EventStreamResponse:
    """A job as server-sent events: its items so far and then as they come (from
    this instance's memory when it runs it, else from a store that keeps them),
    then its output or error."""
    instance = instance_of(request)
    job_id = request.path_params["job_id"]
    key_id = key_id_of(request)
    start = resume_index(request.headers.get("last-event-id"))
    job = await instance.job(job_id, key_id=key_id)  # 404 before any 200
    holds: Holds = request.app.state.holds
    holds.take(key_id)  # given back once the stream ends (`on_end`)
    heartbeat_s = instance.settings.sse_heartbeat_s
    path = request.url.path

    async def recorded_end() -> bytes | None:
        # The run was cut off: a cancelled job's record is final already (the store
        # is written before the work is cut), and its end is what a later follower gets.
        try:
            final = await instance.job(job_id, key_id=key_id)
        except ThawError:
            return None
        return sse.job_final_event(final, path) if final.status.final else None

    async def events() -> AsyncIterator[bytes]:
        current = job
        stream = instance.job_stream(job_id)
        if stream is not None and not current.status.final:
            live = sse.stream_events(stream, start, heartbeat_s, path, cut_end=recorded_end)
            async for chunk in live:
                yield chunk
            return
        # Not streamed here: its items as the store has them, where it keeps them
        # (a fleet's), wherever the job runs; else heartbeats and its end.
        stored = instance.jobs.stored_items(job_id, key_id=key_id, start=start, idle_s=heartbeat_s)
        if stored is not None:
            async with aclosing(sse.stored_events(stored, start, path)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        while not current.status.final:
            yield sse.HEARTBEAT
            current = await instance.job(job_id, key_id=key_id, wait_s=heartbeat_s)
        yield sse.job_final_event(current, path)

    return sse.EventStreamResponse(events(), on_end=lambda: holds.give(key_id))


async def cancel_job(request: Request) -> Response:
    """Cancel a job that has not finished."""
    job = await instance_of(request).cancel_job(
        request.path_params["job_id"], key_id=key_id_of(request)
    )
    return JSONBody(job.public())

"""`POST /invoke/{handler}`: the deadline rule over HTTP (and the body of a submit).

What the route makes of `Prefer` is runtime/http/prefer.py's docstring; the
answer is the handler's output (200), its event stream (`Accept:
text/event-stream`), or a job (202).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from runtime.dispatch.answers import JOB_NOW, STREAM, STREAM_JOB_NOW, WAIT
from runtime.errors import ThawError
from runtime.http import sse
from runtime.http.auth import KEY_ID_SCOPE
from runtime.http.edge import PICKED_SCOPE, request_id_of
from runtime.http.holds import Holds
from runtime.http.intake import Intake, parse_json
from runtime.http.prefer import NO_PREFERENCES, Preferences, parse_prefer
from runtime.http.responses import OutputResponse, job_response, server_timing
from runtime.instance import Instance
from runtime.wire.outputs import encode_output


async def invocation(request: Request, *, force_async: bool) -> Response | sse.EventStreamResponse:
    """The answer to an invocation of `{handler}`; `force_async`: a submit (always 202)."""
    scope = request.scope
    state = scope["app"].state
    instance: Instance = state.instance
    intake: Intake = state.intake
    settings = instance.settings
    name = scope["path_params"]["handler"]
    size = 0
    try:  # the body's bytes count against THAW_MAX_BUFFERED_BYTES until the answer
        try:
            raw = await intake.read(request, settings.max_body_bytes)
            size = len(raw)
            event = parse_json(raw, settings.max_json_depth)
            # The submit route always answers 202 and reads no preference; with no
            # Prefer header there is nothing to parse (the warm path's common case).
            lines = None if force_async else scope[PICKED_SCOPE].get(b"prefer")
            prefs = parse_prefer(lines) if lines else NO_PREFERENCES
        except ThawError as exc:
            instance.count_refused(name, exc.status)
            raise
        wait_s = prefs.wait_s
        if wait_s is not None and wait_s > settings.max_wait_s:
            wait_s = settings.max_wait_s  # bounded as `?wait=` is
        key_id = scope.get(KEY_ID_SCOPE)  # set by the auth layer; None without keys
        accept = None if force_async else scope[PICKED_SCOPE].get(b"accept")
        if accept is not None and sse.wants_events(accept.decode("latin-1")):
            # An event stream holds its connection (runtime/http/holds.py): refused
            # before any work begins, given back once the stream ends.
            return await _streamed(
                instance, state.holds, key_id, name, event, wait_s, prefs, request
            )
        # `respond-async` alone: 202 at once. With `wait=S` too, the common reading of
        # RFC 7240 (§4.1, §4.3): answer within S seconds if the work can, else 202.
        at_once = force_async or (prefs.respond_async and prefs.wait_s is None)
        answer = await instance.invoke(
            name,
            event,
            wait_s=wait_s,
            policy=JOB_NOW if at_once else WAIT,
            request_id=scope["thaw.request_id"],
            key_id=key_id,
        )
        if answer.job is not None:
            applied = "respond-async" if prefs.respond_async else None
            return job_response(answer.job, 202, answer.retry_after_s, applied=applied)
        body = encode_output(name, answer.output)
        return OutputResponse(body, server_timing(answer.timings_ms, answer.batch_size))
    finally:
        intake.release(size)


async def _streamed(
    instance: Instance,
    holds: Holds,
    key_id: str | None,
    name: str,
    event: object,
    wait_s: float | None,
    prefs: Preferences,
    request: Request,
) -> Response | sse.EventStreamResponse:
    """An invocation asked for as an event stream: its stream once it began, or
    (cold past the deadline) its job. Holds its connection while it streams."""
    holds.take(key_id)
    try:
        answer = await instance.invoke(
            name,
            event,
            wait_s=wait_s,
            # `respond-async` alone: its job at once, its items kept for a follower.
            policy=STREAM_JOB_NOW if prefs.respond_async and prefs.wait_s is None else STREAM,
            request_id=request_id_of(request),
            key_id=key_id,
        )
        if answer.stream is None:  # its job
            holds.give(key_id)
            applied = "respond-async" if prefs.respond_async else None
            assert answer.job is not None
            return job_response(answer.job, 202, answer.retry_after_s, applied=applied)
        timing = {"Server-Timing": server_timing(answer.timings_ms)}
        heartbeat_s = instance.settings.sse_heartbeat_s
        return await sse.invocation_response(
            answer.stream, heartbeat_s, request.url.path, timing, lambda: holds.give(key_id)
        )
    except BaseException:
        holds.give(key_id)
        raise


async def invoke(request: Request) -> Response | sse.EventStreamResponse:
    """Invoke a handler; 200 with its output (or its event stream with
    `Accept: text/event-stream`), or 202 with a job past the deadline."""
    return await invocation(request, force_async=False)

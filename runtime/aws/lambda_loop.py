"""The Lambda Runtime API loop: `python -m runtime` with AWS_LAMBDA_RUNTIME_API set.

    init    build the ASGI app and run its lifespan startup (handler discovery,
            job store, prewarm); a failure is posted to /runtime/init/error and
            the process exits 1
    loop    GET /runtime/invocation/next -> route the event through the same
            HTTP contract, in process -> POST .../response or .../error ->
            wait until no background job of this instance runs -> next

Events (see `runtime.aws.events` for the HTTP shape):

    Function URL / HTTP API v2   -> the request as sent; answered with the proxy
                                    result {statusCode, headers, body, isBase64Encoded},
                                    whose errors are problem+json as over HTTP
    {"handler": N, "input": I, "wait_s"?: S}
                                 -> {"output": ...} on 200, a Lambda error otherwise;
                                    not done within S (default THAW_WAIT_S, never past
                                    the function timeout): the job object, marked
                                    {"thaw": "job", ..., "poll": {"job": ID}}, and a
                                    warning line in the function's log
    {"job": ID, "wait_s"?: S}    -> the job object (polling without a Function URL)
    {"handler": N, "input": I, "stream": true}
                                 -> streamed through the Runtime API: a JSON line per
                                    item, then {"output": ...} (runtime/aws/streaming.py)

With THAW_INVOKE_MODE=RESPONSE_STREAM (the Function URL's invoke mode, from
template.yaml), Function URL events are answered by response streaming too:
an event stream reaches the caller event by event.

A Lambda error is made by runtime/wire/render.py's `lambda_error` from the error
object itself: the app hands every error it answers, with its traceback, to
`ERROR_SINK` (runtime/http/problems.py) while the loop holds one, and the loop
raises it again; nothing is parsed back out of a problem+json body. errorType
is the problem slug, except for an exception raised by a handler's own code:
its class (`ValueError`), with its user frames as stackTrace, as AWS's Python
runtime reports it.

A buffered answer Lambda would refuse (over 6 MB, runtime/aws/limits.py) is
never posted: a Function URL's caller gets 500 `response-too-large` saying
so, a direct invocation the Lambda error `response-too-large`; both name what
carries it (a stream, up to 200 MB). Posted, Lambda would only fail it as
Function.ResponseSizeTooLarge, a Function URL's caller seeing a bare 502.

The deadline handed to the app (`Prefer: wait`) is the smaller of the caller's
and the time left before `Lambda-Runtime-Deadline-Ms` less a margin of 5 % of
that time, clamped to [0.2 s, 1 s]: enough to create a job and post the 202
before Lambda's own timeout kills the instance. A 202'd job keeps running in
this process; `next` is requested only once the dispatcher is idle, because
Lambda freezes the instance while it waits on `next`.

With AWS_LAMBDA_MAX_CONCURRENCY = N > 1, N workers share one app, so loaded
models and the single-flight cache are shared too.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import orjson

from runtime import process
from runtime.aws import limits
from runtime.aws.events import HttpRequest, HttpResponse, is_http_event, request_from_event
from runtime.aws.events import result_from_response as proxy_result
from runtime.aws.lambda_api import RuntimeAPI, RuntimeAPIGone
from runtime.aws.streaming import Streamer
from runtime.clock import Clock
from runtime.context import CLIENT_CONTEXT
from runtime.errors import InvalidEvent, ThawError
from runtime.http.edge import INVOCATION_ID
from runtime.http.problems import ERROR_SINK, ErrorSink
from runtime.models.weights import host as host_memory
from runtime.settings import Settings
from runtime.telemetry.logs import DEFERRED_LOGS, configure_logging
from runtime.wire.render import LambdaError, lambda_error, problem

if TYPE_CHECKING:
    from runtime.instance import Instance

log = logging.getLogger("thaw.lambda")

MIN_MARGIN_S = 0.2
MAX_MARGIN_S = 1.0
MARGIN_FRACTION = 0.05
# Lambda's only writable disk is /tmp; used where THAW_* leaves these unset.
_LAMBDA_DEFAULTS = {
    "THAW_CACHE_DIR": "/tmp/thaw/cache",
    "THAW_STATE_DIR": "/tmp/thaw/state",
    "THAW_JOB_STORE": "sqlite:////tmp/thaw/jobs.sqlite3",
}


def budget_s(deadline_ms: int, now_s: float) -> float:
    """Seconds the app may take: time to Lambda's deadline less the margin.

    No deadline header (a Runtime API that sends none) means no Lambda limit.
    """
    if deadline_ms <= 0:
        return math.inf
    remaining = deadline_ms / 1000.0 - now_s
    margin = min(max(remaining * MARGIN_FRACTION, MIN_MARGIN_S), MAX_MARGIN_S)
    return max(0.0, remaining - margin)


def deadline_on(clock: Clock, deadline_ms: int) -> float:
    """Lambda's deadline (epoch ms, less the margin) as a time on `clock.monotonic()`.

    The wall clock is read once, here, as the invocation arrives: from then on
    the deadline is the monotonic clock's, which a wall-clock step cannot move.
    """
    return clock.monotonic() + budget_s(deadline_ms, clock.wall())


def prefer_with_wait(prefer: str | None, limit_s: float, default_s: float) -> str:
    """`prefer` with its `wait` lowered to `limit_s` (added when absent).

    An unparsable wait is left alone so the app answers its `invalid-prefer`.
    `respond-async` with no wait of the caller's gets none added: it is a 202
    at once, where `respond-async, wait=S` is 200 if the work can within S.
    """
    parts = [p.strip() for p in (prefer or "").split(",") if p.strip()]
    out: list[str] = []
    seen_wait = asynchronous = False
    for part in parts:
        name, _, value = part.split(";", 1)[0].partition("=")
        if name.strip().lower() != "wait":
            asynchronous = asynchronous or name.strip().lower() == "respond-async"
            out.append(part)
            continue
        seen_wait = True
        try:
            caller_s = float(value.strip().strip('"'))
        except ValueError:
            out.append(part)
            continue
        out.append(f"wait={min(caller_s, limit_s):.3f}")
    if not seen_wait and not asynchronous:
        out.append(f"wait={min(default_s, limit_s):.3f}")
    return ", ".join(out)


class Invoker:
    """Routes one event through the in-process ASGI app."""

    def __init__(
        self, client: httpx.AsyncClient, settings: Settings, streamer: Streamer | None = None
    ) -> None:
        self.client = client
        self.settings = settings
        self.streamer = streamer

    async def send(self, request: HttpRequest) -> HttpResponse:
        response = await self.client.request(
            request.method, request.target, headers=request.raw_headers, content=request.body
        )
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.headers.raw]
        return HttpResponse(response.status_code, headers, response.content)

    async def send_for_error(self, request: HttpRequest) -> tuple[HttpResponse, BaseException]:
        """`send`, and what the app answered with if it was an error (else a placeholder)."""
        sink: ErrorSink = []
        token = ERROR_SINK.set(sink)
        try:
            response = await self.send(request)
        finally:
            ERROR_SINK.reset(token)
        if not sink:
            # The app renders every error it raises; one answered elsewhere (none
            # today) is named by its status alone.
            return response, ThawError(f"the app answered {response.status}")
        error, frames = sink[-1]
        return response, error.with_traceback(frames)

    async def handle(self, event: Any, request_id: str, limit_s: float) -> tuple[bytes | None, int]:
        """The response payload for `event` and the app's status; raises the error otherwise.
        A payload of None: the answer was streamed to the Runtime API already."""
        if is_http_event(event):
            request = request_from_event(event)
            headers = [(k, v) for k, v in request.headers if k != "prefer"]
            prefer = prefer_with_wait(request.header("prefer"), limit_s, self.settings.wait_s)
            headers.append(("prefer", prefer))
            if request.header("x-request-id") is None:
                headers.append(("x-request-id", request_id))
            request = replace(request, headers=headers)
            if self.streamer is not None and self.settings.invoke_mode == "RESPONSE_STREAM":
                return None, await self.streamer.http(request, request_id)
            response = await self.send(request)
            payload = orjson.dumps(proxy_result(response))
            if len(payload) > limits.MAX_RESPONSE_BYTES:
                # Lambda would refuse it, and the URL's caller see a bare 502: say why.
                response = problem_response(limits.too_large(len(payload)), request)
                payload = orjson.dumps(proxy_result(response))
            return payload, response.status
        if isinstance(event, dict) and isinstance(event.get("handler"), str):
            if event.get("stream") is True and self.streamer is not None:
                wait_s = min(self._caller_wait(event, limit_s), limit_s)
                streamed = await self.streamer.direct(event, request_id, wait_s)
                return streamed if streamed is not None else (None, 200)
            return await self._direct(event, request_id, limit_s)
        if isinstance(event, dict) and isinstance(event.get("job"), str):
            wait_s = min(self._caller_wait(event, limit_s), limit_s)
            path = f"/jobs/{quote(event['job'], safe='')}"
            response, error = await self.send_for_error(
                HttpRequest("GET", path, f"wait={wait_s:.3f}")
            )
            if response.status != 200:
                raise error
            if len(response.body) > limits.MAX_RESPONSE_BYTES:
                raise limits.too_large(len(response.body))
            return response.body, response.status
        raise InvalidEvent(
            'expected a Function URL / HTTP API v2 event, {"handler": NAME, "input": {...}}'
            ' or {"job": ID}'
        )

    def _caller_wait(self, event: Mapping[str, Any], limit_s: float) -> float:
        wait = event.get("wait_s", self.settings.wait_s)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
            raise InvalidEvent("wait_s must be a number >= 0")
        return float(wait)

    async def _direct(
        self, event: Mapping[str, Any], request_id: str, limit_s: float
    ) -> tuple[bytes, int]:
        wait_s = min(self._caller_wait(event, limit_s), limit_s)
        try:
            body = orjson.dumps(event.get("input", {}))
        except TypeError as exc:  # orjson refuses e.g. integers past 64 bits
            raise InvalidEvent(f"input: {exc}") from exc
        headers = [
            ("content-type", "application/json"),
            ("prefer", f"wait={wait_s:.3f}"),
            ("x-request-id", request_id),
        ]
        path = f"/invoke/{quote(event['handler'], safe='')}"
        response, error = await self.send_for_error(HttpRequest("POST", path, "", headers, body))
        if response.status == 200:
            # The body is the handler's JSON already; wrap it without a re-parse.
            payload = b'{"output":' + (response.body or b"null") + b"}"
            if len(payload) > limits.MAX_RESPONSE_BYTES:
                raise limits.too_large(len(payload))  # a Lambda error that says why
            return payload, 200
        if response.status == 202:
            # Not done by the deadline: the job, marked as one (an answer of a sync
            # Invoke has no status code to say it), with the event that polls it.
            job = orjson.loads(response.body)
            log.warning(
                "%s not done within %.3f s (the event's wait_s, else THAW_WAIT_S=%g, never"
                ' past the function timeout): answered with job %s; poll it with {"job": "%s"}',
                event["handler"],
                wait_s,
                self.settings.wait_s,
                job["id"],
                job["id"],
            )
            return orjson.dumps({"thaw": "job", **job, "poll": {"job": job["id"]}}), 202
        raise error


def problem_response(exc: ThawError, request: HttpRequest) -> HttpResponse:
    """`exc` as the app would answer it: problem+json, the request's id kept."""
    headers = [("content-type", "application/problem+json")]
    if (request_id := request.header("x-request-id")) is not None:
        headers.append(("x-request-id", request_id))
    body = orjson.dumps(problem(exc, request.path.split("?")[0]))
    return HttpResponse(exc.status, headers, body)


def _client_context(text: str | None) -> Any:
    """Lambda-Runtime-Client-Context decoded (JSON); None when absent or not JSON."""
    if not text:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


async def _worker(api: RuntimeAPI, invoker: Invoker, instance: Instance, concurrency: int) -> None:
    while True:
        # Asking for the next event may freeze the sandbox (and a frozen one may be
        # reaped): the access lines of what was answered are written first.
        DEFERRED_LOGS.flush()
        invocation = await api.next()
        clock = instance.clock
        started = clock.monotonic()
        deadline_at = deadline_on(clock, invocation.deadline_ms)
        if concurrency == 1 and invocation.trace_id:
            os.environ["_X_AMZN_TRACE_ID"] = invocation.trace_id
        limit_s = max(0.0, deadline_at - clock.monotonic())
        payload: bytes | None = b""
        error: LambdaError | None = None
        status = 0
        try:
            try:
                event = orjson.loads(invocation.event)
            except orjson.JSONDecodeError as exc:
                raise InvalidEvent(f"not JSON: {exc}") from exc
            # The invocation's ClientContext, for the handler's ctx.client_context
            # (runtime/context.py): the app runs in this task, and no header carries it.
            token = CLIENT_CONTEXT.set(_client_context(invocation.client_context))
            # The app's request id is the invocation's (runtime/http/edge.py).
            id_token = INVOCATION_ID.set(invocation.request_id)
            try:
                payload, status = await invoker.handle(event, invocation.request_id, limit_s)
            finally:
                INVOCATION_ID.reset(id_token)
                CLIENT_CONTEXT.reset(token)
        except ThawError as exc:
            error = lambda_error(exc)
        except Exception as exc:
            # A bug in the runtime, not the handler: answer it and keep the instance.
            log.exception("invocation %s failed in the runtime", invocation.request_id)
            error = lambda_error(exc)
        took_ms = (clock.monotonic() - started) * 1000.0
        outcome = str(status) if error is None else error["errorType"]
        # Logged before the post, so the emulator's log tail of this invocation holds it.
        log.info(
            "invocation %s %s in %.1f ms",
            invocation.request_id,
            outcome,
            took_ms,
            extra={"request_id": invocation.request_id, "duration_ms": round(took_ms, 3)},
        )
        if error is None:
            if payload is not None:  # None: streamed (runtime/aws/streaming.py)
                await api.respond(invocation.request_id, payload)
        else:
            await api.fail(invocation.request_id, error)
        # Lambda freezes a one-at-a-time instance while it waits on `next`, so a
        # 202'd job must end first. With several workers the process is not
        # frozen; only the worker that handed out a job waits, so it is not lost
        # to an idle instance being retired.
        if concurrency == 1 or status == 202:
            await instance.wait_idle()


async def run(address: str, concurrency: int = 1, environ: Mapping[str, str] | None = None) -> int:
    """Serve invocations from the Runtime API at `address` until it goes away."""
    env = dict(os.environ if environ is None else environ)
    for key, value in _LAMBDA_DEFAULTS.items():
        env.setdefault(key, value)
    async with AsyncExitStack() as stack:
        api = RuntimeAPI(address)
        stack.push_async_callback(api.aclose)
        try:
            settings = Settings.from_env(env)
            configure_logging(settings.log_level)
            host_memory.configure(settings)
            from runtime.http.app import create_app

            app = create_app(settings)
            await stack.enter_async_context(app.router.lifespan_context(app))
        except Exception as exc:
            log.error("init failed: %s: %s", type(exc).__name__, exc)
            await api.init_error(lambda_error(exc))
            return 1
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        client = httpx.AsyncClient(transport=transport, base_url="http://lambda", timeout=None)
        stack.push_async_callback(client.aclose)
        instance: Instance = app.state.instance
        invoker = Invoker(client, settings, Streamer(address, app, instance))
        log.info("ready: %d worker(s) on %s", concurrency, address)
        workers = asyncio.gather(
            *(_worker(api, invoker, instance, concurrency) for _ in range(concurrency))
        )
        # A drain (the instance wedged: a thread of user code is stuck) ends the
        # loop and the process, non-zero, so Lambda replaces the environment.
        instance.exit_hook = workers.cancel
        try:
            await workers
        except (httpx.TransportError, RuntimeAPIGone) as exc:
            # Stopped (410) or gone: the environment's end, not a fault.
            log.info("runtime API unreachable or stopping (%s); exiting", exc)
            return 0
        except asyncio.CancelledError:
            log.warning("drained; exiting so the platform starts a fresh environment")
            return 1
    return 0


def main() -> int:
    configure_logging("INFO")  # until the settings name the level
    # One line per invocation is ours; httpx would add three per invocation.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    address = os.environ["AWS_LAMBDA_RUNTIME_API"]
    try:
        concurrency = max(1, int(os.environ.get("AWS_LAMBDA_MAX_CONCURRENCY") or 1))
    except ValueError:
        concurrency = 1
    code = process.run(run(address, concurrency))
    process.exit_past_stuck_threads(code)
    return code

"""The Lambda Invoke API: `POST /2015-03-31/functions/{name}/invocations`.

    X-Amz-Invocation-Type   RequestResponse (default): 200 with the payload,
                            X-Amz-Executed-Version, X-Amz-Function-Error: Unhandled
                            on a function error, X-Amz-Log-Result with LogType Tail
                            Event: 202 at once; run in the background, waiting for
                            capacity, retried twice on a function error, every
                            attempt under the request id the 202 gave
                            DryRun: 204
    errors                  as Lambda: {"Type": "User", "message": ...} with
                            x-amzn-ErrorType (ResourceNotFoundException 404,
                            TooManyRequestsException 429, ...)

With LogType Tail the answer waits for the invocation's end (the instance's
next `next`), since the log it carries ends in the REPORT.

`name` is the logical id or FunctionName, also as an ARN or with a qualifier
(`ThawFunction:$LATEST`); every qualifier runs the template's code. Lambda
retries failed asynchronous invocations after 1 and 2 minutes; the emulator
after EVENT_RETRY_DELAYS_S, so the effect shows up while you watch.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.emulator.invocation import Throttled
from runtime.emulator.pool import Pool
from runtime.emulator.template import ACCOUNT, REGION, FunctionConfig, Template

log = logging.getLogger("thaw.emulator")

MAX_SYNC_PAYLOAD_BYTES = 6 * 1024 * 1024
MAX_EVENT_PAYLOAD_BYTES = 1024 * 1024
EVENT_RETRY_DELAYS_S = (0.5, 1.0)
ARN_PREFIX = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:"
INVOCATION_TYPES = frozenset({"RequestResponse", "Event", "DryRun"})


def aws_error(status: int, error_type: str, message: str, **extra: Any) -> Response:
    return JSONResponse(
        {"Type": "User", "message": message, **extra},
        status_code=status,
        headers={"x-amzn-ErrorType": error_type, "x-amzn-RequestId": str(uuid.uuid4())},
    )


class EventQueue:
    """Asynchronous invocations in flight, retried like Lambda's event queue."""

    def __init__(self, pool: Pool, retry_delays_s: tuple[float, ...] = EVENT_RETRY_DELAYS_S):
        self.pool = pool
        self.retry_delays_s = retry_delays_s
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, function: FunctionConfig, payload: bytes, request_id: str) -> None:
        task = asyncio.ensure_future(self._run(function, payload, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, function: FunctionConfig, payload: bytes, request_id: str) -> None:
        for attempt, delay_s in enumerate((0.0, *self.retry_delays_s), start=1):
            await asyncio.sleep(delay_s)
            try:
                # Lambda retries an event under its original request id.
                outcome = await self.pool.invoke(
                    function, payload, wait_for_capacity=True, request_id=request_id
                )
            except Throttled:
                return  # shutting down
            if outcome.error_type is None:
                return
            log.warning(
                "event %s attempt %d failed with %s", request_id, attempt, outcome.error_type
            )
        log.error("event %s dropped after %d attempts", request_id, attempt)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _client_context(request: Request) -> str | None:
    """X-Amz-Client-Context is base64 JSON; the runtime receives it decoded."""
    raw = request.headers.get("x-amz-client-context")
    if raw is None:
        return None
    try:
        return base64.b64decode(raw, validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return raw


async def invoke(request: Request) -> Response:
    template: Template = request.app.state.template
    pool: Pool = request.app.state.pool
    name = request.path_params["name"]
    function = template.find(name)
    if function is None:
        arn = name if name.startswith("arn:") else f"{ARN_PREFIX}{name}"
        return aws_error(404, "ResourceNotFoundException", f"Function not found: {arn}")
    invocation_type = request.headers.get("x-amz-invocation-type", "RequestResponse")
    if invocation_type not in INVOCATION_TYPES:
        return aws_error(
            400,
            "InvalidParameterValueException",
            f"Unsupported invocation type {invocation_type!r}",
        )
    body = await request.body() or b"{}"
    limit = MAX_EVENT_PAYLOAD_BYTES if invocation_type == "Event" else MAX_SYNC_PAYLOAD_BYTES
    if len(body) > limit:
        return aws_error(
            413,
            "RequestTooLargeException",
            f"Request must be smaller than {limit} bytes for the InvokeFunction operation",
        )
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return aws_error(
            400, "InvalidRequestContentException", f"Could not parse request body into json: {exc}"
        )
    if invocation_type == "DryRun":
        return Response(status_code=204)
    if invocation_type == "Event":
        request_id = str(uuid.uuid4())
        request.app.state.events.submit(function, body, request_id)
        return Response(status_code=202, headers={"x-amzn-RequestId": request_id})
    try:
        outcome = await pool.invoke(function, body, client_context=_client_context(request))
    except Throttled as exc:
        return aws_error(429, "TooManyRequestsException", "Rate Exceeded.", Reason=exc.reason)
    headers = {"X-Amz-Executed-Version": "$LATEST", "x-amzn-RequestId": outcome.request_id}
    if outcome.error_type is not None:
        headers["X-Amz-Function-Error"] = "Unhandled"
    if request.headers.get("x-amz-log-type") == "Tail":
        finished = await asyncio.shield(outcome.finished)
        headers["X-Amz-Log-Result"] = base64.b64encode(finished.log_tail()).decode("ascii")
    return Response(outcome.payload, headers=headers, media_type="application/json")


routes = [Route("/2015-03-31/functions/{name}/invocations", invoke, methods=["POST"])]

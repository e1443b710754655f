"""The Lambda API, as far as a local function needs it:

    POST /2015-03-31/functions/{name}/invocations          Invoke
    GET  /2015-03-31/functions/{name}                      GetFunction
    GET  /2015-03-31/functions/{name}/configuration        GetFunctionConfiguration
    GET  /2015-03-31/functions[/]                          ListFunctions (FunctionVersion=ALL,
                                                           MaxItems, Marker)
    any other path under an API version (/2015-03-31/...)  404 UnknownOperationException

so `aws lambda get-function` and boto3 work against it. The three reads answer
from the template (runtime.emulator.template); nothing is ever deployed.

Invoke:

    X-Amz-Invocation-Type   RequestResponse (default): 200 with the payload,
                            X-Amz-Executed-Version, X-Amz-Function-Error: Unhandled
                            on a function error, X-Amz-Log-Result with LogType Tail
                            Event: 202 at once; run in the background, waiting for
                            capacity, retried twice on a function error, every
                            attempt under the request id the 202 gave
                            DryRun: 204
    limits                  Lambda's (runtime/aws/limits.py): a payload over 6 MB (1 MB
                            for Event) is 413 RequestEntityTooLargeException with the
                            message of its invocation type; a response over 6 MB is
                            200 + Unhandled, Function.ResponseSizeTooLarge
    errors                  as Lambda: {"Type": "User", "message": ...} with
                            x-amzn-ErrorType (ResourceNotFoundException 404,
                            TooManyRequestsException 429, ...)

With LogType Tail the answer waits for the invocation's end (the sandbox's
next `next`), since the log it carries ends in the REPORT.

`name` is the logical id or FunctionName, also as a (partial) ARN, and with a
qualifier (`ThawFunction:live`) or a `Qualifier` parameter: `$LATEST`, a
version or an alias the template publishes; any other is
ResourceNotFoundException, and a name's qualifier other than the parameter's is
InvalidParameterValueException, as on Lambda. Every version runs the
template's code; X-Amz-Executed-Version (and a configuration's `Version`) is
the version the qualifier names, `$LATEST` without one, and so are the START
line and the sandbox's AWS_LAMBDA_FUNCTION_VERSION: each version runs in
sandboxes of its own. X-Amz-Client-Context
(base64 of a JSON object; ClientContext in boto3) reaches a synchronous
invocation's handler as `ctx.client_context`, as on Lambda (an Event
invocation's is not passed on).

Lambda retries failed asynchronous invocations after 1 and 2 minutes; the
emulator after EVENT_RETRY_DELAYS_S, so the effect shows up while you watch.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import re
import time
import uuid
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route
from starlette.types import Scope

from runtime.aws import limits
from runtime.emulator.invocation import Throttled, error_payload
from runtime.emulator.pool import Pool
from runtime.emulator.template import (
    ACCOUNT,
    REGION,
    FunctionConfig,
    QualifierMismatch,
    Template,
    split_name,
)

log = logging.getLogger("thaw.emulator")

EVENT_RETRY_DELAYS_S = (0.5, 1.0)
ARN_PREFIX = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:"
INVOCATION_TYPES = frozenset({"RequestResponse", "Event", "DryRun"})
# Lambda's limit on an invocation's ClientContext (base64 characters).
MAX_CLIENT_CONTEXT_CHARS = 3583


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

    def submit(
        self,
        function: FunctionConfig,
        payload: bytes,
        request_id: str,
        version: str = "$LATEST",
        qualifier: str | None = None,
    ) -> None:
        run = self._run(function, payload, request_id, version, qualifier)
        task = asyncio.ensure_future(run)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(
        self,
        function: FunctionConfig,
        payload: bytes,
        request_id: str,
        version: str,
        qualifier: str | None,
    ) -> None:
        for attempt, delay_s in enumerate((0.0, *self.retry_delays_s), start=1):
            await asyncio.sleep(delay_s)
            try:
                # Lambda retries an event under its original request id.
                outcome = await self.pool.invoke(
                    function,
                    payload,
                    wait_for_capacity=True,
                    request_id=request_id,
                    version=version,
                    qualifier=qualifier,
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
    """X-Amz-Client-Context (base64 JSON) decoded, as the Runtime API hands it on.

    Raises ValueError unless it is base64 of a JSON object within Lambda's limit.
    """
    raw = request.headers.get("x-amz-client-context")
    if raw is None:
        return None
    if len(raw) > MAX_CLIENT_CONTEXT_CHARS:
        raise ValueError(f"Client context must be at most {MAX_CLIENT_CONTEXT_CHARS} bytes.")
    try:
        text = base64.b64decode(raw, validate=True).decode("utf-8")
        if isinstance(orjson.loads(text), dict):
            return text
    except ValueError:  # binascii.Error, UnicodeDecodeError, JSONDecodeError
        pass
    raise ValueError("Client context must be a valid Base64-encoded JSON object.")


def _not_found(name: str, qualifier: str | None) -> Response:
    arn = name if name.startswith("arn:") else f"{ARN_PREFIX}{split_name(name)[0]}"
    if qualifier is not None and not name.startswith("arn:"):
        arn += f":{qualifier}"
    return aws_error(404, "ResourceNotFoundException", f"Function not found: {arn}")


def _resolve(request: Request) -> tuple[FunctionConfig, str | None, str] | Response:
    """(function, qualifier, version) the request names, or Lambda's error answer."""
    template: Template = request.app.state.template
    name = request.path_params["name"]
    try:
        function, qualifier, version = template.target(name, request.query_params.get("Qualifier"))
    except QualifierMismatch as exc:
        return aws_error(400, "InvalidParameterValueException", str(exc))
    if function is None or version is None:
        return _not_found(name, qualifier)
    return function, qualifier, version


async def read_payload(
    request: Request, operation: str, invocation_type: str = "RequestResponse"
) -> tuple[bytes, str | None] | Response:
    """An invocation's payload (JSON, within Lambda's limit for its invocation type)
    and its decoded ClientContext, or the error Lambda answers for either."""
    body = await request.body() or b"{}"
    # Lambda quotas: 6 MB synchronous, 1 MB asynchronous (runtime/aws/limits.py).
    if invocation_type == "Event" and len(body) > limits.MAX_EVENT_REQUEST_BYTES:
        message = limits.event_request_message(len(body))
        return aws_error(413, limits.REQUEST_TOO_LARGE, message)
    if len(body) > limits.MAX_SYNC_REQUEST_BYTES:
        message = limits.sync_request_message(operation)
        return aws_error(413, limits.REQUEST_TOO_LARGE, message)
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return aws_error(
            400, "InvalidRequestContentException", f"Could not parse request body into json: {exc}"
        )
    try:
        return body, _client_context(request)
    except ValueError as exc:
        return aws_error(400, "InvalidRequestContentException", str(exc))


async def invoke(request: Request) -> Response:
    pool: Pool = request.app.state.pool
    resolved = _resolve(request)
    if isinstance(resolved, Response):
        return resolved
    function, qualifier, version = resolved
    invocation_type = request.headers.get("x-amz-invocation-type", "RequestResponse")
    if invocation_type not in INVOCATION_TYPES:
        return aws_error(
            400,
            "InvalidParameterValueException",
            f"Unsupported invocation type {invocation_type!r}",
        )
    read = await read_payload(request, "InvokeFunction", invocation_type)
    if isinstance(read, Response):
        return read
    body, client_context = read
    if invocation_type == "DryRun":
        return Response(status_code=204)
    if invocation_type == "Event":
        request_id = str(uuid.uuid4())
        request.app.state.events.submit(function, body, request_id, version, qualifier)
        return Response(status_code=202, headers={"x-amzn-RequestId": request_id})
    try:
        outcome = await pool.invoke(
            function, body, client_context=client_context, version=version, qualifier=qualifier
        )
    except Throttled as exc:
        return aws_error(429, "TooManyRequestsException", "Rate Exceeded.", Reason=exc.reason)
    headers = {"X-Amz-Executed-Version": version, "x-amzn-RequestId": outcome.request_id}
    payload, error_type = outcome.payload, outcome.error_type
    if outcome.stream is not None:
        # A plain invoke of a function that streamed: the whole answer, as Lambda gives it.
        payload = await outcome.stream.read_all()
        if (error_type := outcome.stream.error_type) is not None:
            payload = outcome.stream.error_body
        elif len(payload) > limits.MAX_RESPONSE_BYTES:  # buffered now: the buffered limit
            error_type = limits.RESPONSE_TOO_LARGE
            payload = error_payload(error_type, limits.response_message(len(payload)))
    if error_type is not None:
        headers["X-Amz-Function-Error"] = "Unhandled"
    if request.headers.get("x-amz-log-type") == "Tail":
        finished = await asyncio.shield(outcome.finished)
        headers["X-Amz-Log-Result"] = base64.b64encode(finished.log_tail()).decode("ascii")
    return Response(payload, headers=headers, media_type="application/json")


# ---- the reads: GetFunction, GetFunctionConfiguration, ListFunctions ---------------


def configuration(
    function: FunctionConfig,
    template: Template,
    version: str = "$LATEST",
    qualifier: str | None = None,
) -> dict[str, Any]:
    """The function's FunctionConfiguration, as Lambda describes a deployed one."""
    digest = hashlib.sha256(
        orjson.dumps([function.logical_id, function.image_uri, template.loaded_at])
    ).digest()
    described: dict[str, Any] = {
        "FunctionName": function.name,
        "FunctionArn": function.arn if qualifier is None else f"{function.arn}:{qualifier}",
        "Role": f"arn:aws:iam::{ACCOUNT}:role/{function.logical_id}Role",
        "CodeSize": 0,
        "Description": function.description,
        "Timeout": int(function.timeout_s),
        "MemorySize": function.memory_mb,
        "LastModified": time.strftime(
            "%Y-%m-%dT%H:%M:%S.000+0000", time.gmtime(template.loaded_at)
        ),
        "CodeSha256": base64.b64encode(digest).decode("ascii"),
        "Version": version,
        "Environment": {"Variables": dict(function.environment)},
        "TracingConfig": {"Mode": "PassThrough"},
        "RevisionId": str(uuid.UUID(bytes=digest[:16])),
        "State": "Active",
        "LastUpdateStatus": "Successful",
        "PackageType": function.package_type,
        "Architectures": list(function.architectures),
        "EphemeralStorage": {"Size": function.ephemeral_mb},
        "LoggingConfig": {"LogFormat": "Text", "LogGroup": f"/aws/lambda/{function.name}"},
    }
    if function.handler is not None:
        described["Handler"] = function.handler
    if function.runtime is not None:
        described["Runtime"] = function.runtime
    return described


async def get_function(request: Request) -> Response:
    resolved = _resolve(request)
    if isinstance(resolved, Response):
        return resolved
    function, qualifier, version = resolved
    template: Template = request.app.state.template
    code: dict[str, str]
    if function.package_type == "Image" and function.image_uri is not None:
        code = {"RepositoryType": "ECR", "ImageUri": function.image_uri}
    elif function.code_dir is not None:  # a Zip function: its code, in place
        code = {"RepositoryType": "S3", "Location": function.code_dir.as_uri()}
    else:
        code = {"RepositoryType": "S3", "Location": f"file://{function.logical_id}"}
    answer: dict[str, Any] = {
        "Configuration": configuration(function, template, version, qualifier),
        "Code": code,
    }
    if function.reserved_concurrency is not None:
        answer["Concurrency"] = {"ReservedConcurrentExecutions": function.reserved_concurrency}
    return JSONResponse(answer, headers={"x-amzn-RequestId": str(uuid.uuid4())})


async def get_function_configuration(request: Request) -> Response:
    resolved = _resolve(request)
    if isinstance(resolved, Response):
        return resolved
    function, qualifier, version = resolved
    template: Template = request.app.state.template
    return JSONResponse(
        configuration(function, template, version, qualifier),
        headers={"x-amzn-RequestId": str(uuid.uuid4())},
    )


async def list_functions(request: Request) -> Response:
    template: Template = request.app.state.template
    params = request.query_params
    every_version = params.get("FunctionVersion")
    if every_version not in (None, "ALL"):
        return aws_error(400, "InvalidParameterValueException", "FunctionVersion must be ALL")
    try:
        max_items = int(params.get("MaxItems", "50"))
        start = int(params.get("Marker", "0"))
    except ValueError:
        return aws_error(400, "InvalidParameterValueException", "MaxItems and Marker are integers")
    if not 1 <= max_items <= 10000 or start < 0:
        return aws_error(400, "InvalidParameterValueException", "MaxItems is 1 to 10000")
    described = []
    for function in template.functions.values():
        described.append(configuration(function, template))
        if every_version == "ALL":
            described += [configuration(function, template, v, v) for v in function.versions]
    answer: dict[str, Any] = {"Functions": described[start : start + max_items]}
    if start + max_items < len(described):
        answer["NextMarker"] = str(start + max_items)
    return JSONResponse(answer, headers={"x-amzn-RequestId": str(uuid.uuid4())})


async def unknown_operation(request: Request) -> Response:
    return aws_error(
        404,
        "UnknownOperationException",
        f"Unknown operation: {request.method} {request.url.path} (thaw emulate serves Invoke, "
        "GetFunction, GetFunctionConfiguration and ListFunctions)",
    )


# A path under a Lambda API version: /2015-03-31/..., /2017-03-31/..., /2021-10-31/...
_API_PATH = re.compile(r"^/\d{4}-\d{2}-\d{2}(/|$)")
_ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class ApiPathRoute(Route):
    """Matches only paths under a Lambda API version: the rest is the Function URL's."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http" or not _API_PATH.match(scope["path"]):
            return Match.NONE, {}
        return super().matches(scope)


routes = [
    Route("/2015-03-31/functions/{name}/invocations", invoke, methods=["POST"]),
    # The documented path ends in a slash; botocore sends it without.
    Route("/2015-03-31/functions/", list_functions, methods=["GET"]),
    Route("/2015-03-31/functions", list_functions, methods=["GET"]),
    Route("/2015-03-31/functions/{name}", get_function, methods=["GET"]),
    Route(
        "/2015-03-31/functions/{name}/configuration", get_function_configuration, methods=["GET"]
    ),
    ApiPathRoute("/{rest:path}", unknown_operation, methods=_ANY_METHOD),
]

"""Every path that is not the Invoke API: the HTTP contract, as a Function URL serves it.

The request becomes a Function URL event (payload format 2.0) for the
template's URL function (its AutoPublishAlias's version, where it has one,
as SAM puts the URL on that alias), runs on a sandbox, and the proxy result
becomes the response. As with a real Function URL: past the sandbox limit 429, a
function error or an invalid proxy result 502.
"""

from __future__ import annotations

import time
import uuid

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.aws import limits
from runtime.aws.events import HttpRequest, event_from_request, response_from_payload
from runtime.emulator.invocation import Throttled
from runtime.emulator.pool import Pool
from runtime.emulator.streaming import url_response
from runtime.emulator.template import Template
from runtime.errors import InvalidEvent

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


async def forward(request: Request) -> Response:
    template: Template = request.app.state.template
    pool: Pool = request.app.state.pool
    request_id = str(uuid.uuid4())
    ids = {"x-amzn-RequestId": request_id}
    body = await request.body()
    if len(body) > limits.MAX_SYNC_REQUEST_BYTES:  # a buffered URL's request: Invoke's limit
        return JSONResponse({"Message": "Request Entity Too Large"}, 413, headers=ids)
    scope = request.scope
    http_request = HttpRequest(
        method=request.method,
        path=(scope.get("raw_path") or scope["path"].encode()).decode("ascii", "replace"),
        query=scope.get("query_string", b"").decode("ascii", "replace"),
        headers=[(k.decode("latin-1"), v.decode("utf-8", "replace")) for k, v in scope["headers"]],
        body=body,
    )
    event = event_from_request(
        http_request,
        request_id=request_id,
        domain=request.headers.get("host", "localhost"),
        source_ip=request.client.host if request.client else "127.0.0.1",
        now_s=time.time(),
    )
    function = template.url_function()
    qualifier = function.url_qualifier  # the alias SAM puts the URL on, if any
    version = function.version_of(qualifier) or "$LATEST"
    try:
        outcome = await pool.invoke(
            function,
            orjson.dumps(event),
            request_id=request_id,  # the URL's x-amzn-RequestId is the invocation's
            version=version,
            qualifier=qualifier,
        )
    except Throttled:
        return JSONResponse({"Message": "Rate Exceeded."}, 429, headers=ids)
    if outcome.stream is not None:
        return await url_response(outcome.stream, ids)
    if outcome.error_type is not None:
        # Function URLs hide the error; the type is kept in a header for local debugging.
        headers = {**ids, "X-Amz-Function-Error": outcome.error_type}
        return JSONResponse({"Message": "Internal Server Error"}, 502, headers=headers)
    try:
        result = response_from_payload(outcome.payload)
    except InvalidEvent as exc:
        headers = {**ids, "X-Amz-Function-Error": exc.slug}
        return JSONResponse({"Message": "Internal Server Error"}, 502, headers=headers)
    response = Response(result.body, status_code=result.status)
    response.raw_headers.extend(
        (k.encode("latin-1"), v.encode("utf-8")) for k, v in [*result.headers, *ids.items()]
    )
    return response


routes = [Route("/{path:path}", forward, methods=METHODS)]

"""The platform side of the Lambda Runtime API, one per instance.

Each instance's AWS_LAMBDA_RUNTIME_API is `127.0.0.1:PORT/instances/{iid}`,
so these routes know which instance speaks without a port per instance.

    GET  /instances/{iid}/2018-06-01/runtime/invocation/next
    POST /instances/{iid}/2018-06-01/runtime/invocation/{rid}/response
    POST /instances/{iid}/2018-06-01/runtime/invocation/{rid}/error
    POST /instances/{iid}/2018-06-01/runtime/init/error
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.emulator.pool import Pool

PREFIX = "/instances/{iid}/2018-06-01/runtime"
ERROR_TYPE_HEADER = "lambda-runtime-function-error-type"
_ACCEPTED = {"status": "OK"}


def _pool(request: Request) -> Pool:
    pool: Pool = request.app.state.pool
    return pool


def _error_type(request: Request, body: bytes) -> str:
    """The error type: from the body's errorType, else the header, else Unhandled."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("errorType"), str):
        return str(payload["errorType"])
    return request.headers.get(ERROR_TYPE_HEADER) or "Unhandled"


async def next_invocation(request: Request) -> Response:
    invocation = await _pool(request).next(request.path_params["iid"])
    if invocation is None:
        # The instance is being stopped; it is signalled as well.
        return JSONResponse({"errorType": "Runtime.Stopping"}, status_code=410)
    headers = {
        "Lambda-Runtime-Aws-Request-Id": invocation.request_id,
        "Lambda-Runtime-Deadline-Ms": str(invocation.deadline_ms),
        "Lambda-Runtime-Invoked-Function-Arn": invocation.function_arn,
        "Lambda-Runtime-Trace-Id": invocation.trace_id,
    }
    if invocation.client_context:
        headers["Lambda-Runtime-Client-Context"] = invocation.client_context
    return Response(invocation.payload, headers=headers, media_type="application/json")


async def invocation_response(request: Request) -> Response:
    body = await request.body()
    done = await _pool(request).complete(
        request.path_params["iid"], request.path_params["rid"], body, None
    )
    return _answer(done)


async def invocation_error(request: Request) -> Response:
    body = await request.body()
    done = await _pool(request).complete(
        request.path_params["iid"], request.path_params["rid"], body, _error_type(request, body)
    )
    return _answer(done)


async def init_error(request: Request) -> Response:
    body = await request.body()
    _pool(request).init_failed(request.path_params["iid"], _error_type(request, body), body)
    return JSONResponse(_ACCEPTED, status_code=202)


def _answer(done: bool) -> Response:
    if done:
        return JSONResponse(_ACCEPTED, status_code=202)
    # As Lambda: the invocation already ended (timed out) or never existed.
    return JSONResponse(
        {"errorMessage": "Invalid request ID", "errorType": "InvalidRequestID"}, status_code=400
    )


routes = [
    Route(f"{PREFIX}/invocation/next", next_invocation, methods=["GET"]),
    Route(f"{PREFIX}/invocation/{{rid}}/response", invocation_response, methods=["POST"]),
    Route(f"{PREFIX}/invocation/{{rid}}/error", invocation_error, methods=["POST"]),
    Route(f"{PREFIX}/init/error", init_error, methods=["POST"]),
]

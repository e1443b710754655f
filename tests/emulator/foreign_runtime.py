"""A handler module that, imported at init, becomes a Runtime API client of its own.

It speaks the Runtime API with the standard library's `http.client`, handed
AWS_LAMBDA_RUNTIME_API as it comes, as awslambdaric does to post an init error:
`http.client.HTTPConnection(address)` refuses anything but `host[:port]`
(`InvalidURL: nonnumeric port` for an address with a path). FOREIGN_MODE picks:

    init-error   post an init error as awslambdaric does, then exit 1
    serve        answer every event with {"foreign": event, "address": ..., "version":
                 AWS_LAMBDA_FUNCTION_VERSION}, forever (after sleeping the event's
                 "sleep_s", so callers can overlap); with "pad_bytes": N in the event
                 (or a Function URL event's query string) padded by N bytes, and a
                 refused post printed as `response post: STATUS BODY`

Thaw's own loop never starts: the import does not return.
"""

from __future__ import annotations

import http
import http.client
import json
import os
import time

ADDRESS = os.environ["AWS_LAMBDA_RUNTIME_API"]
PREFIX = "/2018-06-01/runtime"


def _post(path: str, body: bytes, headers: dict[str, str] | None = None) -> int:
    connection = http.client.HTTPConnection(ADDRESS)
    connection.request("POST", f"{PREFIX}{path}", body, headers=headers or {})
    response = connection.getresponse()
    answer = response.read()
    connection.close()
    if response.status != http.HTTPStatus.ACCEPTED:
        print(f"response post: {response.status} {answer.decode()}", flush=True)
    return response.status


def _pad_bytes(payload: object) -> int:
    if not isinstance(payload, dict):
        return 0
    query = payload.get("queryStringParameters") or {}
    return int(
        payload.get("pad_bytes") or (query.get("pad_bytes") if isinstance(query, dict) else 0) or 0
    )


def _init_error() -> None:
    error = {"errorType": "Runtime.ForeignInitError", "errorMessage": "init failed on purpose"}
    headers = {"Lambda-Runtime-Function-Error-Type": "Runtime.ForeignInitError"}
    status = _post("/init/error", json.dumps(error).encode(), headers)
    os._exit(0 if status == http.HTTPStatus.ACCEPTED else 2)


def _serve() -> None:
    while True:
        connection = http.client.HTTPConnection(ADDRESS)
        connection.request("GET", f"{PREFIX}/invocation/next")
        response = connection.getresponse()
        event = response.read()
        if response.status != http.HTTPStatus.OK:
            os._exit(0)  # the emulator is stopping this instance
        request_id = response.getheader("Lambda-Runtime-Aws-Request-Id")
        connection.close()
        payload = json.loads(event)
        time.sleep(float(payload.get("sleep_s", 0)) if isinstance(payload, dict) else 0.0)
        answer = {
            "foreign": payload,
            "address": ADDRESS,
            "pid": os.getpid(),
            "version": os.environ.get("AWS_LAMBDA_FUNCTION_VERSION"),
            "pad": "x" * _pad_bytes(payload),
        }
        _post(f"/invocation/{request_id}/response", json.dumps(answer).encode())


if os.environ.get("FOREIGN_MODE") == "init-error":
    _init_error()
elif os.environ.get("FOREIGN_MODE") == "serve":
    _serve()

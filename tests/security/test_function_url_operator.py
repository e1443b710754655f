"""Through a Function URL, anyone allowed to invoke it is a tenant: a real Lambda
loop refuses drain, load and unload events (the instance keeps serving), and
serves every tenant route."""

from __future__ import annotations

import base64
from collections.abc import Callable

from tests.aws.conftest import LambdaProcess, runtime_api, start_runtime, tiny_bundles
from tests.aws.fake_runtime_api import FakeRuntimeAPI

__all__ = ["runtime_api", "start_runtime", "tiny_bundles"]  # the fixtures, used by name
Start = Callable[..., LambdaProcess]


def http_event(method: str, path: str) -> dict[str, object]:
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": "",
        "headers": {"content-type": "application/json"},
        "requestContext": {"http": {"method": method, "path": path}},
        "body": base64.b64encode(b"{}").decode(),
        "isBase64Encoded": True,
    }


def test_no_function_url_event_drains_or_unloads(
    start_runtime: Start, runtime_api: FakeRuntimeAPI
) -> None:
    start_runtime(THAW_HANDLERS="tests.handlers.echo")
    refused = [
        runtime_api.push(http_event("POST", "/drain")),
        runtime_api.push(http_event("POST", "/dr%61in")),
        runtime_api.push(http_event("DELETE", "/models/tiny")),
        runtime_api.push(http_event("POST", "/models/tiny/load")),
    ]
    served = runtime_api.push(http_event("POST", "/invoke/echo"))
    ready = runtime_api.push(http_event("GET", "/readyz"))
    for request_id in refused:
        posted = runtime_api.result(request_id)
        assert posted.kind == "error", posted
        assert posted.headers["lambda-runtime-function-error-type"] == "not-found"
        assert "Function URL" in posted.json()["errorMessage"]
    answer = runtime_api.result(served)
    assert answer.kind == "response" and answer.json()["statusCode"] == 200
    # Not drained: still ready, and a later invocation is still served.
    assert runtime_api.result(ready).json()["statusCode"] == 200
    again = runtime_api.push(http_event("POST", "/invoke/echo"))
    assert runtime_api.result(again).json()["statusCode"] == 200

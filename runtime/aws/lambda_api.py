"""The client side of the Lambda Runtime API (version 2018-06-01).

    GET  /runtime/invocation/next                -> event + Lambda-Runtime-* headers
    POST /runtime/invocation/{id}/response       payload
    POST /runtime/invocation/{id}/error          {errorType, errorMessage, stackTrace}
    POST /runtime/init/error                     same, then the process exits

`AWS_LAMBDA_RUNTIME_API` is a plain `host:port`, on Lambda and under `thaw
emulate` alike (the emulator gives every sandbox a listener of its own), and
URLs are built by appending the API's paths to it.

`next` answered 410 Gone (the environment is being stopped: `thaw emulate`
stopping, an image's container whose PID 1 ignores SIGTERM) raises
`RuntimeAPIGone`, which the loop takes as the end of its work, as it takes a
Runtime API that no longer answers: the process exits quietly, no traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import orjson

from runtime.aws import limits
from runtime.wire.render import LambdaError

VERSION = "2018-06-01"
ERROR_TYPE_HEADER = "Lambda-Runtime-Function-Error-Type"


class RuntimeAPIGone(Exception):
    """The Runtime API hands out no more invocations (410 Gone): time to exit."""


@dataclass(frozen=True)
class Invocation:
    request_id: str
    # Epoch milliseconds by which Lambda ends the invocation.
    deadline_ms: int
    function_arn: str
    trace_id: str | None
    event: bytes
    # Lambda-Runtime-Client-Context: the caller's ClientContext, as JSON text (None: none).
    client_context: str | None = None


class RuntimeAPI:
    """Talks to the Runtime API at `address` (host:port)."""

    def __init__(self, address: str, transport: httpx.AsyncBaseTransport | None = None) -> None:
        base = f"http://{address.rstrip('/')}/{VERSION}/runtime"
        # `next` is a long poll: no read timeout there; the posts are quick.
        self._client = httpx.AsyncClient(
            base_url=base, transport=transport, timeout=httpx.Timeout(30.0, read=None)
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def next(self) -> Invocation:
        response = await self._client.get("/invocation/next")
        if response.status_code == 410:
            raise RuntimeAPIGone(f"GET /runtime/invocation/next: 410 Gone {response.text[:200]}")
        response.raise_for_status()
        headers = response.headers
        return Invocation(
            request_id=headers["lambda-runtime-aws-request-id"],
            deadline_ms=int(headers.get("lambda-runtime-deadline-ms", "0")),
            function_arn=headers.get("lambda-runtime-invoked-function-arn", ""),
            trace_id=headers.get("lambda-runtime-trace-id"),
            event=response.content,
            client_context=headers.get("lambda-runtime-client-context"),
        )

    async def respond(self, request_id: str, payload: bytes) -> None:
        response = await self._client.post(f"/invocation/{request_id}/response", content=payload)
        if response.status_code == 413:
            # Lambda refuses responses over 6 MB (the loop posts none: runtime/aws/limits.py);
            # the caller still gets an answer.
            too_large = LambdaError(
                errorType=limits.RESPONSE_TOO_LARGE,
                errorMessage=limits.response_message(len(payload)),
                stackTrace=[],
            )
            await self.fail(request_id, too_large)
            return
        self._check(response)

    async def fail(self, request_id: str, error: LambdaError) -> None:
        """Post `error` (runtime/wire/render.py's `lambda_error`) as the invocation's answer."""
        await self._post_error(f"/invocation/{request_id}/error", error)

    async def init_error(self, error: LambdaError) -> None:
        await self._post_error("/init/error", error)

    async def _post_error(self, path: str, error: LambdaError) -> None:
        response = await self._client.post(
            path, content=orjson.dumps(error), headers={ERROR_TYPE_HEADER: error["errorType"]}
        )
        self._check(response)

    @staticmethod
    def _check(response: httpx.Response) -> None:
        # 4xx means this invocation is gone (timed out, answered): carry on.
        # 5xx means the Runtime API is in a state the runtime must exit on.
        if response.status_code >= 500:
            response.raise_for_status()

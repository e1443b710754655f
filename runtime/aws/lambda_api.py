"""The client side of the Lambda Runtime API (version 2018-06-01).

    GET  /runtime/invocation/next                -> event + Lambda-Runtime-* headers
    POST /runtime/invocation/{id}/response       payload
    POST /runtime/invocation/{id}/error          {errorType, errorMessage, stackTrace}
    POST /runtime/init/error                     same, then the process exits

`AWS_LAMBDA_RUNTIME_API` is a plain `host:port`, on Lambda and under `thaw
emulate` alike (the emulator gives every instance a listener of its own), and
URLs are built by appending the API's paths to it.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

VERSION = "2018-06-01"
ERROR_TYPE_HEADER = "Lambda-Runtime-Function-Error-Type"
_RUNTIME_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
_PATHS = sysconfig.get_paths()
_STDLIB = _PATHS["stdlib"] + os.sep
# site-packages may sit inside the stdlib dir, and the image may install user handlers there.
_SITE = tuple({_PATHS["purelib"] + os.sep, _PATHS["platlib"] + os.sep})


def _hidden(filename: str) -> bool:
    """The runtime's own frames and the standard library's (importlib around an import)."""
    if filename.startswith((_RUNTIME_DIR, "<frozen")):
        return True
    return filename.startswith(_STDLIB) and not filename.startswith(_SITE)


@dataclass(frozen=True)
class LambdaError:
    """The error payload of the Runtime API; `type` is the problem slug."""

    type: str
    message: str
    stack_trace: list[str] = field(default_factory=list)

    def payload(self) -> bytes:
        return orjson.dumps(
            {"errorType": self.type, "errorMessage": self.message, "stackTrace": self.stack_trace}
        )


class FunctionError(Exception):
    """An invocation ends in a Lambda error rather than a response."""

    def __init__(self, error: LambdaError) -> None:
        super().__init__(error.message)
        self.error = error


def user_frames(exc: BaseException) -> list[str]:
    """Frames of `exc` (and what caused it) outside the runtime and the standard library.

    Like awslambdaric, a trace shows the user's code only: the runtime's own
    frames are noise to whoever reads a failed invocation.
    """
    frames: list[traceback.FrameSummary] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = [
            frame
            for frame in traceback.extract_tb(current.__traceback__)
            if not _hidden(frame.filename)
        ] + frames
        current = current.__cause__ or current.__context__
    return traceback.format_list(frames)


@dataclass(frozen=True)
class Invocation:
    request_id: str
    # Epoch milliseconds by which Lambda ends the invocation.
    deadline_ms: int
    function_arn: str
    trace_id: str | None
    event: bytes


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
        response.raise_for_status()
        headers = response.headers
        return Invocation(
            request_id=headers["lambda-runtime-aws-request-id"],
            deadline_ms=int(headers.get("lambda-runtime-deadline-ms", "0")),
            function_arn=headers.get("lambda-runtime-invoked-function-arn", ""),
            trace_id=headers.get("lambda-runtime-trace-id"),
            event=response.content,
        )

    async def respond(self, request_id: str, payload: bytes) -> None:
        response = await self._client.post(f"/invocation/{request_id}/response", content=payload)
        if response.status_code == 413:
            # Lambda refuses responses over 6 MB; the caller still gets an answer.
            message = f"response of {len(payload)} bytes exceeds the Runtime API limit"
            await self.fail(request_id, LambdaError("Function.ResponseSizeTooLarge", message))
            return
        self._check(response)

    async def fail(self, request_id: str, error: LambdaError) -> None:
        response = await self._client.post(
            f"/invocation/{request_id}/error",
            content=error.payload(),
            headers={ERROR_TYPE_HEADER: error.type},
        )
        self._check(response)

    async def init_error(self, error: LambdaError) -> None:
        response = await self._client.post(
            "/init/error", content=error.payload(), headers={ERROR_TYPE_HEADER: error.type}
        )
        self._check(response)

    @staticmethod
    def _check(response: httpx.Response) -> None:
        # 4xx means this invocation is gone (timed out, answered): carry on.
        # 5xx means the Runtime API is in a state the runtime must exit on.
        if response.status_code >= 500:
            response.raise_for_status()

"""One error, every surface: the only place a `ThawError` becomes what a caller reads.

    problem(exc, request_path)  RFC 9457 problem details, the HTTP body (runtime/http/problems.py)
    http_headers(exc)           the headers that go with it: Retry-After,
                                WWW-Authenticate, Allow
    job_error(exc)              a job record's `error`: type, message[, retryable]  (runtime/jobs)
    lambda_error(exc)           the Runtime API's error payload           (runtime/aws)
    cli_line(exc)               the one line `thaw` prints on stderr       (runtime/cli)
    user_traceback(exc)         user code's frames: `thaw invoke`'s stderr, the log's ERROR record
    cli_exit_code(exc)          and the code it exits with

The problem type slug names an error on every surface: the problem's `type`,
the job's `error.type`, the Lambda `errorType`. One exception, on Lambda
only: an exception raised by a handler's own code is reported as AWS's Python
runtime reports it, its class as `errorType` (`ValueError`), its message as
`errorMessage` and its frames as `stackTrace`, user frames only; Lambda's
tooling (metric filters, Step Functions' `Catch` on an error name) then sees
what it sees for any Python function. Thaw's own errors, a handler's
`InvalidInput` among them, keep their slugs there too.

Only `lambda_error` takes any exception: the Runtime API must be answered
whatever went wrong, and a fault of the runtime itself is `Runtime.<Class>`,
as Lambda names its runtimes' failures. The other surfaces decide for
themselves what an unexpected exception means (the HTTP app logs it and
answers 500 `internal`) and hand a ThawError here.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import sysconfig
import traceback
from pathlib import Path
from typing import Any, TypedDict

from runtime.errors import (
    HandlerError,
    InvalidInput,
    MethodNotAllowed,
    ThawError,
    Unauthorized,
    UnknownHandler,
)

PROBLEM_TYPE_BASE = "https://thaw.dev/problems/"
CLI_PREFIX = "thaw: error: "
# `thaw`'s exit codes (docs/cli.md, "Output and exit codes").
EXIT_FAILED = 1  # the command ran and failed
EXIT_USAGE = 2  # the command line is wrong: a flag, an argument, an unreadable --event
EXIT_INVALID_INPUT = 3  # a handler refused its event (invalid-input)

# The runtime package (this module lives in runtime/wire/).
_RUNTIME_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
_PATHS = sysconfig.get_paths()
_STDLIB = os.path.realpath(_PATHS["stdlib"]) + os.sep
# site-packages may sit inside the stdlib dir, and the image may install user handlers there.
_SITE = tuple({os.path.realpath(_PATHS[key]) + os.sep for key in ("purelib", "platlib")})
# The server stack that calls a handler over HTTP (the Lambda loop too routes
# events through the ASGI app): its frames are the runtime's, wherever installed.
_SERVER_STACK = ("starlette", "anyio", "httpx", "httpcore", "uvicorn", "h11")


class LambdaError(TypedDict):
    """The body of `POST /runtime/invocation/{id}/error` and `/runtime/init/error`."""

    errorType: str
    errorMessage: str
    stackTrace: list[str]


def retry_after(seconds: float) -> str:
    """A Retry-After value: whole seconds, at least 1 (0 would invite a busy loop)."""
    return str(max(1, math.ceil(seconds)))


def problem(exc: ThawError, request_path: str | None = None) -> dict[str, Any]:
    """RFC 9457 problem details; `request_path` is the RFC's `instance` member."""
    body: dict[str, Any] = {
        "type": PROBLEM_TYPE_BASE + exc.slug,
        "title": exc.title,
        "status": exc.status,
        "detail": exc.message,
    }
    if request_path:
        body["instance"] = request_path
    body.update(exc.extra)
    return body


def http_headers(exc: ThawError) -> dict[str, str]:
    """The headers an HTTP answer of `exc` carries besides its problem body."""
    headers: dict[str, str] = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = retry_after(exc.retry_after_s)
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="thaw"'
    if isinstance(exc, MethodNotAllowed):
        headers["Allow"] = ", ".join(exc.allow)
    return headers


def job_error(exc: BaseException) -> dict[str, Any]:
    """A job's (or a failed load's) `error`; anything not a ThawError is `internal`."""
    if not isinstance(exc, ThawError):
        return {"type": ThawError.slug, "message": f"{type(exc).__name__}: {exc}"}
    error: dict[str, Any] = {"type": exc.slug, "message": exc.message}
    if exc.retryable:
        error["retryable"] = True
    return error


def lambda_error(exc: BaseException) -> LambdaError:
    """The Runtime API's error payload for `exc` (see the module docstring)."""
    cause = exc.__cause__
    if isinstance(exc, HandlerError) and cause is not None and not isinstance(cause, ThawError):
        return LambdaError(
            errorType=type(cause).__name__, errorMessage=str(cause), stackTrace=user_frames(cause)
        )
    if isinstance(exc, ThawError):
        return LambdaError(
            errorType=exc.slug, errorMessage=exc.message, stackTrace=user_frames(exc)
        )
    return LambdaError(
        errorType=f"Runtime.{type(exc).__name__}",
        errorMessage=str(exc),
        stackTrace=user_frames(exc),
    )


def cli_line(exc: ThawError) -> str:
    """`thaw: error: <slug>: <message>`; the root class, which names nothing, has no slug."""
    if type(exc) is ThawError:
        return CLI_PREFIX + exc.message
    return f"{CLI_PREFIX}{exc.slug}: {exc.message}"


def cli_exit_code(exc: ThawError) -> int:
    """The exit code of a command that ended with `exc`."""
    if isinstance(exc, InvalidInput):
        return EXIT_INVALID_INPUT
    if isinstance(exc, UnknownHandler):
        return EXIT_USAGE  # a handler name the command line gave
    return EXIT_FAILED


@functools.cache
def _runtime_dirs() -> tuple[str, ...]:
    """The runtime's directory and its server stack's, found without importing them."""
    dirs = [_RUNTIME_DIR]
    for name in _SERVER_STACK:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs += [str(Path(d).resolve()) + os.sep for d in spec.submodule_search_locations]
    return tuple(dirs)


@functools.lru_cache(maxsize=1024)
def _hidden(filename: str) -> bool:
    """The runtime's own frames, its server stack's and the standard library's
    (importlib around an import, a thread pool around a sync handler).

    Compared as real paths: a frame's file is named as it was imported (a
    virtualenv reached through a symlink, say), the directories resolved."""
    if filename.startswith("<frozen"):
        return True
    real = os.path.realpath(filename)
    if real.startswith(_runtime_dirs()):
        return True
    return real.startswith(_STDLIB) and not real.startswith(_SITE)


def user_frames(exc: BaseException) -> list[str]:
    """Frames of `exc` (and what caused it) outside the runtime and the standard library.

    As AWS's own runtime does, a trace shows the user's code only: the
    runtime's frames are noise to whoever reads a failed invocation. Each
    frame is its file, line, function and source line; never a local
    variable, so no part of an event reaches a trace.
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


def user_traceback(exc: BaseException, *, message: bool = True) -> str:
    """`exc`'s traceback as Python prints it, its user frames only (`user_frames`), ending
    with the user's own exception (the cause a HandlerError or LoadFailed wraps); ""
    when no frame of user code is in it (a fault of the runtime or of a bundle's files).
    Without `message`, the last line names the exception's class only: its message may
    hold the caller's input, which a log never does."""
    frames = user_frames(exc)
    if not frames:
        return ""
    origin: BaseException = exc
    while isinstance(origin, ThawError) and origin.__cause__ is not None:
        origin = origin.__cause__
    if message:
        last = "".join(traceback.format_exception_only(type(origin), origin))
    else:
        last = f"{type(origin).__module__}.{type(origin).__qualname__}\n".removeprefix("builtins.")
    return "Traceback (most recent call last):\n" + "".join(frames) + last

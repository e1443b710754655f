"""The error tree as drawn is the tree in code, and each surface renders it one way."""

from __future__ import annotations

import inspect
import re

import pytest

from runtime import errors
from runtime.errors import (
    Cancelled,
    Draining,
    HandlerError,
    HandlerTimeout,
    InvalidInput,
    LoadFailed,
    MethodNotAllowed,
    QueueFull,
    ThawError,
    Unauthorized,
    UnknownJob,
    WorkerLost,
)
from runtime.wire.render import cli_line, http_headers, job_error, lambda_error, problem

# "    │   ├── InvalidJSON            400 invalid-json   (...)"
_LINE = re.compile(r"^(?P<indent>[ │├└─]*)(?P<name>[A-Z]\w+)\s+(?P<status>\d{3}) (?P<slug>[a-z-]+)")


def drawn_tree() -> dict[str, tuple[str | None, int, str]]:
    """name -> (parent name, status, slug), from the module docstring's drawing."""
    assert errors.__doc__ is not None
    tree: dict[str, tuple[str | None, int, str]] = {}
    stack: list[tuple[int, str]] = []  # (depth, name)
    for line in errors.__doc__.splitlines():
        found = _LINE.match(line.removeprefix("    "))
        if found is None:
            continue
        depth = len(found["indent"]) // 4
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parent = stack[-1][1] if stack else None
        tree[found["name"]] = (parent, int(found["status"]), found["slug"])
        stack.append((depth, found["name"]))
    return tree


def coded_tree() -> dict[str, tuple[str | None, int, str]]:
    tree: dict[str, tuple[str | None, int, str]] = {}
    for name, cls in inspect.getmembers(errors, inspect.isclass):
        if issubclass(cls, ThawError) and cls.__module__ == errors.__name__:
            base = cls.__bases__[0]
            parent = base.__name__ if issubclass(base, ThawError) else None
            tree[name] = (parent, cls.status, cls.slug)
    return tree


def test_the_drawn_tree_is_the_tree_in_code() -> None:
    drawn = drawn_tree()
    assert len(drawn) > 20  # the drawing was read, not skipped
    assert drawn == coded_tree()


def test_every_slug_names_one_class() -> None:
    slugs = [slug for _, _, slug in coded_tree().values()]
    assert len(slugs) == len(set(slugs))


def test_problem_details_and_their_headers() -> None:
    exc = QueueFull("handler 'x' has 64 requests queued", retry_after_s=2.2, limit=64)
    assert problem(exc, "/invoke/x") == {
        "type": "https://thaw.dev/problems/queue-full",
        "title": "Queue full",
        "status": 429,
        "detail": "handler 'x' has 64 requests queued",
        "instance": "/invoke/x",
        "limit": 64,
    }
    assert http_headers(exc) == {"Retry-After": "3"}
    assert http_headers(LoadFailed("broke", retry_after_s=0.01)) == {"Retry-After": "1"}
    assert http_headers(Unauthorized("no key")) == {"WWW-Authenticate": 'Bearer realm="thaw"'}
    assert http_headers(MethodNotAllowed("no", allow=["GET", "POST"])) == {"Allow": "GET, POST"}
    assert "instance" not in problem(UnknownJob("no job 'x'"))


def test_job_errors_come_from_classes() -> None:
    assert job_error(Cancelled("cancelled by the client")) == {
        "type": "cancelled",
        "message": "cancelled by the client",
    }
    assert job_error(WorkerLost("gave up"))["type"] == "worker-lost"
    # A drained job may be sent again: the one retryable job error.
    assert job_error(Draining("drained")) == {
        "type": "drained",
        "message": "drained",
        "retryable": True,
    }
    assert job_error(KeyError("k")) == {"type": "internal", "message": "KeyError: 'k'"}


def raise_in_user_code(message: str) -> None:
    raise ValueError(message)


def test_a_handlers_exception_is_reported_on_lambda_as_pythons_runtime_does() -> None:
    try:
        raise_in_user_code("no luck")
    except ValueError as cause:
        error = HandlerError(f"ValueError: {cause}")
        error.__cause__ = cause
    rendered = lambda_error(error)
    assert rendered["errorType"] == "ValueError"
    assert rendered["errorMessage"] == "no luck"
    assert len(rendered["stackTrace"]) == 2  # this test's frames: user code here
    assert "raise ValueError(message)" in rendered["stackTrace"][-1]


def test_thaw_errors_keep_their_slug_on_lambda_and_faults_are_runtime_errors() -> None:
    timeout = lambda_error(HandlerTimeout("took too long"))
    assert timeout == {
        "errorType": "handler-timeout",
        "errorMessage": "took too long",
        "stackTrace": [],
    }
    assert lambda_error(InvalidInput("x", "must be a number"))["errorType"] == "invalid-input"
    assert lambda_error(RuntimeError("bug"))["errorType"] == "Runtime.RuntimeError"


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (
            InvalidInput("celsius", "must be a list"),
            "thaw: error: invalid-input: celsius: must be a list",
        ),
        (ThawError("server exited with 1"), "thaw: error: server exited with 1"),
    ],
)
def test_cli_lines_have_one_prefix(exc: ThawError, line: str) -> None:
    assert cli_line(exc) == line

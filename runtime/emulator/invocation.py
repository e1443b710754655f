"""One invocation's record, its answer and its REPORT.

An `Invocation` is queued on a sandbox, delivered by `next`, answered once
(a response or an error: its `result` future is set once, later answers are
ignored) and ended once, when its worker asks for the next event, or the
sandbox is killed or exits. The caller gets the answer as soon as it is
posted; the REPORT, and the invocation's log with it, come at the end: on
Lambda the work a runtime does between posting a response and calling `next`
(a job answered 202 and still running, say) is part of the invocation and is
billed as such.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import orjson

from runtime.emulator.report import Report, end_line, start_line
from runtime.emulator.sandboxes import Sandbox, max_memory_mb
from runtime.emulator.streaming import ResponseChunks

LOG_TAIL_BYTES = 4096


class Throttled(Exception):
    """No sandbox is free and the function is at its sandbox limit."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Finished:
    report: Report
    # START, the sandbox's output during the invocation, END and REPORT.
    log: bytes

    def log_tail(self) -> bytes:
        return self.log[-LOG_TAIL_BYTES:]


@dataclass(frozen=True)
class Outcome:
    request_id: str
    payload: bytes
    # None for a response; the errorType of a function error otherwise.
    error_type: str | None
    # Set when the invocation ends (its REPORT); may be well after the answer.
    finished: asyncio.Future[Finished]
    # A streamed response (runtime/emulator/streaming.py): its chunks as they come.
    stream: ResponseChunks | None = None


@dataclass
class Invocation:
    request_id: str
    payload: bytes
    trace_id: str
    function_arn: str
    client_context: str | None = None
    # The version invoked (START's `Version:`), as its sandbox runs it.
    version: str = "$LATEST"
    result: asyncio.Future[Outcome] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    finished: asyncio.Future[Finished] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    delivered: asyncio.Event = field(default_factory=asyncio.Event)
    delivered_at: float = 0.0
    deadline_ms: int = 0
    log_offset: int = 0
    # How the invocation ends the REPORT: None (an answer, a function error too),
    # "error" (the runtime died) or "timeout", and the error type beside it.
    status: str | None = None
    error_type: str | None = None
    # Its streamed response, while the runtime sends it.
    stream: ResponseChunks | None = None


def timed_out_message(request_id: str, timeout_s: float) -> str:
    """Lambda's words for an invocation that passed its Timeout, streamed or not."""
    return f"{request_id} Task timed out after {timeout_s:.2f} seconds"


def error_payload(error_type: str, message: str) -> bytes:
    return orjson.dumps({"errorType": error_type, "errorMessage": message})


def answer(
    invocation: Invocation,
    error_type: str | None,
    payload: bytes,
    status: str | None,
    stream: ResponseChunks | None = None,
) -> bool:
    """Hand the caller its answer; False if it had one already."""
    if invocation.result.done():
        return False
    # The REPORT names an error type only beside a Status, as Lambda's does.
    invocation.status = status
    invocation.error_type = error_type if status is not None else None
    invocation.stream = stream
    outcome = Outcome(invocation.request_id, payload, error_type, invocation.finished, stream)
    invocation.result.set_result(outcome)
    return True


def finish(
    sandbox: Sandbox,
    invocation: Invocation,
    *,
    status: str | None = None,
    error_type: str | None = None,
) -> Report | None:
    """End the invocation now: its REPORT (None if it was ended already).

    Duration runs from the delivery of the event to now; the first REPORT of an
    sandbox carries its Init Duration. `status`/`error_type` override the
    answer's (a sandbox killed for working past the timeout after answering).
    """
    if invocation.finished.done():
        return None
    init_ms = None
    if not sandbox.reported_init and sandbox.init_ms is not None:
        init_ms, sandbox.reported_init = sandbox.init_ms, True
    started = invocation.delivered_at or time.monotonic()
    report = Report(
        invocation.request_id,
        duration_ms=(time.monotonic() - started) * 1000.0,
        memory_mb=sandbox.function.memory_mb,
        max_memory_mb=max_memory_mb(sandbox.memory_pid),
        init_ms=init_ms,
        status=status or invocation.status,
        error_type=error_type or invocation.error_type,
    )
    output = sandbox.log.since(invocation.log_offset) if invocation.delivered_at else b""
    log = b"".join(
        (
            start_line(invocation.request_id, invocation.version).encode() + b"\n",
            output,
            end_line(invocation.request_id).encode() + b"\n",
            report.line().encode() + b"\n",
        )
    )
    invocation.finished.set_result(Finished(report, log))
    return report

"""One invocation's record and its outcome: payload, REPORT and log tail.

An `Invocation` is queued on an instance, delivered by `next`, and ends in
exactly one `Outcome` (its future is set once; later answers are ignored).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import orjson

from runtime.emulator.instances import Instance, max_memory_mb
from runtime.emulator.report import Report, end_line, start_line

LOG_TAIL_BYTES = 4096


class Throttled(Exception):
    """No instance is free and the function is at its instance limit."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Outcome:
    request_id: str
    payload: bytes
    # None for a response; the errorType of a function error otherwise.
    error_type: str | None
    report: Report
    # START, the instance's output during the invocation, END and REPORT.
    log: bytes

    def log_tail(self) -> bytes:
        return self.log[-LOG_TAIL_BYTES:]


@dataclass
class Invocation:
    request_id: str
    payload: bytes
    trace_id: str
    function_arn: str
    client_context: str | None = None
    result: asyncio.Future[Outcome] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    delivered: asyncio.Event = field(default_factory=asyncio.Event)
    delivered_at: float = 0.0
    deadline_ms: int = 0
    log_offset: int = 0


def error_payload(error_type: str, message: str) -> bytes:
    return orjson.dumps({"errorType": error_type, "errorMessage": message})


def outcome_of(
    instance: Instance,
    invocation: Invocation,
    error_type: str | None,
    payload: bytes,
    status: str | None,
) -> Outcome:
    """The outcome as the instance stands now; the first one reports its Init Duration."""
    started = invocation.delivered_at or time.monotonic()
    init_ms = None
    if not instance.reported_init and instance.init_ms is not None:
        init_ms, instance.reported_init = instance.init_ms, True
    report = Report(
        invocation.request_id,
        duration_ms=(time.monotonic() - started) * 1000.0,
        memory_mb=instance.function.memory_mb,
        max_memory_mb=max_memory_mb(instance.pid),
        init_ms=init_ms,
        status=status,
        error_type=error_type,
    )
    output = instance.log.since(invocation.log_offset) if invocation.delivered_at else b""
    log = b"".join(
        (
            start_line(invocation.request_id).encode() + b"\n",
            output,
            end_line(invocation.request_id).encode() + b"\n",
            report.line().encode() + b"\n",
        )
    )
    return Outcome(invocation.request_id, payload, error_type, report, log)

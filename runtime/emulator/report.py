"""Lambda's per-invocation log lines: START, END and REPORT.

    REPORT RequestId: <id>\tDuration: 12.34 ms\tBilled Duration: 113 ms\tMemory Size: 512 MB\t
           Max Memory Used: 61 MB\tInit Duration: 100.12 ms[\tStatus: error\tError Type: T]

`Status` is there only where Lambda prints it: `timeout` past the Timeout,
`error` (with the Error Type) when the runtime exited or its init failed. A
function error the runtime posted to /invocation/error is an answer like any
other: its REPORT has no Status.

Duration runs from the delivery of the event (`next`) until the sandbox asks
for its next event (or is killed, or exits), not to the response: on Lambda the
work a runtime does after posting its answer is part of the invocation. Billed
Duration is rounded up to the millisecond and, as for container images,
includes the Init Duration of a cold start. Max Memory Used is the sandbox
process's peak RSS, not the configured size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Report:
    request_id: str
    duration_ms: float
    memory_mb: int
    max_memory_mb: int
    init_ms: float | None = None
    # None for an answer, a function error included; "error" when the runtime
    # exited or failed its init, "timeout" past the Timeout: as Lambda prints it.
    status: str | None = None
    error_type: str | None = None

    @property
    def billed_ms(self) -> int:
        return max(1, math.ceil(self.duration_ms + (self.init_ms or 0.0)))

    def line(self) -> str:
        fields = [
            f"REPORT RequestId: {self.request_id}",
            f"Duration: {self.duration_ms:.2f} ms",
            f"Billed Duration: {self.billed_ms} ms",
            f"Memory Size: {self.memory_mb} MB",
            f"Max Memory Used: {self.max_memory_mb} MB",
        ]
        if self.init_ms is not None:
            fields.append(f"Init Duration: {self.init_ms:.2f} ms")
        if self.status is not None:
            fields.append(f"Status: {self.status}")
        if self.status == "error" and self.error_type is not None:
            # Lambda names the runtime's failure (Runtime.ExitError); a timeout is its own status.
            fields.append(f"Error Type: {self.error_type}")
        return "\t".join(fields)


def start_line(request_id: str, version: str = "$LATEST") -> str:
    """`version`: the one invoked (a qualifier's), as Lambda's START line names it."""
    return f"START RequestId: {request_id} Version: {version}"


def end_line(request_id: str) -> str:
    return f"END RequestId: {request_id}"

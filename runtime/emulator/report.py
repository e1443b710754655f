"""Lambda's per-invocation log lines: START, END and REPORT.

    REPORT RequestId: <id>\tDuration: 12.34 ms\tBilled Duration: 113 ms\tMemory Size: 512 MB\t
           Max Memory Used: 61 MB\tInit Duration: 100.12 ms

Duration runs from the delivery of the event (`next`) until the instance asks
for its next event (or is killed, or exits), not to the response: on Lambda the
work a runtime does after posting its answer is part of the invocation. Billed
Duration is rounded up to the millisecond and, as for container images,
includes the Init Duration of a cold start. Max Memory Used is the instance
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
    # None for a response; "error" or "timeout" otherwise, as Lambda prints it.
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
        if self.error_type is not None:
            fields.append(f"Error Type: {self.error_type}")
        return "\t".join(fields)


def start_line(request_id: str) -> str:
    return f"START RequestId: {request_id} Version: $LATEST"


def end_line(request_id: str) -> str:
    return f"END RequestId: {request_id}"

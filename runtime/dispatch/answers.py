"""What an invocation answers: its output (`Completed`) or its job (`Accepted`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.jobs.job import Job


@dataclass
class Completed:
    output: Any
    timings_ms: dict[str, float]
    # How many requests shared its handler call (None: the handler does not batch).
    batch_size: int | None = None


@dataclass
class Accepted:
    job: Job
    retry_after_s: float

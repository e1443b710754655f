"""What an invocation asks for (`Policy`) and what it answers (`Answer`).

A caller says in one value how it wants to be answered, above all what it
gets when its deadline cannot be met:

    WAIT          its output; past the deadline a 202 job (the work goes on)
    JOB_NOW       a 202 job at once (`Prefer: respond-async`)
    RETRY_LATER   its output; past the deadline a 503 `warming-up` with
                  Retry-After and no job (the OpenAI routes: a client's own
                  retries wait out a cold start; runtime/dispatch/warming.py)
    STREAM        its stream once its handler begins; past the deadline a job
    STREAM_OR_RETRY  its stream; past the deadline a 503 to retry after
    STREAM_JOB_NOW   a 202 job at once, its items kept for whoever follows it

Every answer is one `Answer`: `job` set for a 202 (`Accepted`), `stream` set
for a stream (`Streaming`), else the `output` (`Completed`). A caller reads
the field it needs; the three subclasses exist so that each is built with
only its own fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from runtime.jobs.job import Job

if TYPE_CHECKING:
    from runtime.dispatch.streams import Stream


@dataclass(frozen=True, slots=True)
class Policy:
    """How an invocation is answered (the module docstring names each one used)."""

    # Past the deadline: "job" (202, the work goes on), "retry" (503 warming-up, no
    # job); "job-now": a 202 job at once, whatever the deadline.
    late: Literal["job", "retry", "job-now"] = "job"
    # Answered with the handler's stream once it begins, not its whole output.
    stream: bool = False


WAIT = Policy()
JOB_NOW = Policy("job-now")
RETRY_LATER = Policy("retry")
STREAM = Policy(stream=True)
STREAM_OR_RETRY = Policy("retry", stream=True)
STREAM_JOB_NOW = Policy("job-now", stream=True)


class Answer:
    """What an invocation answers: read `job` (a 202), `stream`, or `output`.

    Plain slotted classes, not dataclasses: the fields an answer lacks read as
    the defaults here, and one is built per request."""

    __slots__ = ()
    # The job of a 202 (`Accepted`), and when to poll it.
    job: Job | None = None
    retry_after_s: float = 0.0
    # The handler's stream, begun (`Streaming`).
    stream: Stream | None = None
    # The handler's output (`Completed`), and how many requests shared its call
    # (None: the handler does not batch).
    output: Any = None
    batch_size: int | None = None
    # Server-Timing's phases (`Completed`, `Streaming`); read-only here.
    timings_ms: dict[str, float] = {}

    def __repr__(self) -> str:
        names: tuple[str, ...] = type(self).__slots__
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        return f"{type(self).__name__}({fields})"


class Completed(Answer):
    __slots__ = ("batch_size", "output", "timings_ms")

    def __init__(
        self, output: Any, timings_ms: dict[str, float], batch_size: int | None = None
    ) -> None:
        self.output = output
        self.timings_ms = timings_ms
        self.batch_size = batch_size


class Accepted(Answer):
    __slots__ = ("job", "retry_after_s")
    job: Job

    def __init__(self, job: Job, retry_after_s: float) -> None:
        self.job = job
        self.retry_after_s = retry_after_s


class Streaming(Answer):
    """The answer to a streaming invocation whose handler began: read `stream`."""

    __slots__ = ("stream", "timings_ms")
    stream: Stream

    def __init__(self, stream: Stream, timings_ms: dict[str, float]) -> None:
        self.stream = stream
        self.timings_ms = timings_ms

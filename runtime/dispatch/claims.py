"""Jobs recorded queued in a fleet: claimed by id just before their handler runs.

A job this instance accepts but cannot start at once, for any capacity reason
(its models are not READY, their memory budget is full, a sync handler's
threads are all busy, a batched handler runs `max_concurrent` batches or has a
queue, a step-level handler's sequences are all taken), is recorded queued,
not running and leased here, so that an idle warm instance of the fleet can
take it (runtime/jobs/fleet.py). A sync caller answered 202 at its deadline
while its work still waited for its models, a run slot or a handler thread
joins the same queue
(`claim_recorded`). Its work still waits here as any other (a load starts, a
thread or a run slot is waited for), and `Work.claim` is the job's claim by
id, made at the last moment: on the handler thread once one is free for it (a
sync handler, or a sequence's prefill once it has a decode slot; a sync call
that already waits in the threads' queue at its caller's deadline is gated
there, `claimed`: a warm call that finds a thread free pays nothing), as its batch
is about to run (a batched one: the batcher holds the run slot while it
claims), or once the models are leased (an async one). One winner: if another
instance claimed the job first, the work ends here without running (cancelled:
nothing is counted, its outcome is discarded), and whoever waits for the job
here reads its row, as for a job another instance accepted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from runtime.dispatch.executor import Executor
from runtime.dispatch.streams import Streams
from runtime.dispatch.work import Work
from runtime.jobs.job import Job
from runtime.jobs.manager import JobManager
from runtime.models.cache import ModelCache
from runtime.registry import HandlerSpec


def waits(spec: HandlerSpec, executor: Executor, cache: ModelCache, busy: bool) -> bool:
    """Whether `spec` would not start at once: for a load (its models are cold), for
    memory (their budget is full: its memory limit), for its declared concurrency
    (`busy`: the batcher's or decode lanes' say) or, a sync handler, for a handler
    thread (the thread limit)."""
    uses = spec.uses
    if busy or not all(map(cache.is_ready, uses)) or not all(map(cache.budget.admits_now, uses)):
        return True
    return not spec.is_async and spec.batch is None and spec.decode is None and executor.saturated()


async def claim_job(jobs: JobManager, streams: Streams, job_id: str, work: Work) -> bool:
    """The claim of a queued job's work (`Work.claim`): True when this instance won it.
    False when another took it first, it was cancelled, or its work was cut off
    meanwhile: the work then ends here unrun."""
    if not work.outcome.done() and await jobs.claim_queued(job_id) and not work.outcome.done():
        if work.stream is not None:
            # Followed here from now on (before, a follower read the store's items).
            streams.hold(job_id, work.stream)
        return True
    work.cancel()
    return False


async def claim_recorded(
    jobs: JobManager, streams: Streams, recorded: asyncio.Future[Job | None], work: Work
) -> bool:
    """The claim of work whose job is being recorded queued as it waits (a sync caller
    answered 202): the record first (None: it failed, and the work is this
    instance's alone), then the claim by id."""
    job = await recorded
    return True if job is None else await claim_job(jobs, streams, job.id, work)


async def claimed(work: Work) -> bool:
    """The gate of a sync call that still waited for a handler thread at its caller's
    deadline (Executor.gate_waiting, `Work.waits`), awaited as a thread takes it:
    the claim set on the work since (`claim_recorded`); True when this instance
    won it or none was set, and the work runs from now (its run limit counts
    from when the thread took it: the executor's watch)."""
    claim, work.claim = work.claim, None
    if (claim is not None and not await claim()) or work.outcome.done():
        return False
    work.started(work.workload.now())
    return True


async def claimed_then(work: Work, run: Callable[[], Coroutine[Any, Any, None] | None]) -> None:
    """Claim the job of async or batched `work`, then `run()` it if this instance won."""
    claim, work.claim = work.claim, None
    if claim is not None and await claim():
        started = run()
        if started is not None:
            await started

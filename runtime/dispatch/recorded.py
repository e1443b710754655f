"""Work answered with a job (a 202): its record, and what follows the record.

The deadline rule (dispatcher.py) decides that an invocation is answered with
a job; this is how it becomes one. The job is recorded before its work starts:
the answer then waits for nothing the work does first (a cold load imports
torch, which holds the GIL), a job the store refuses never runs (the caller
was told it was not taken: docs/reliability.md), and work queued for the fleet
waits for its claim (claims.py). Queued work is followed before it starts, not
after: its models may have turned ready while its record was written, and then
its claim is made in the start's first step, which must find the job held.

A job is then followed: its lease renewed while the work runs, each change
of phase written as it happens, its outcome recorded as it ends
(runtime/jobs/leases.py, manager.py). Work that has ended by then (an async
handler that never waits ends in its first step; a request turned into a job
at its deadline may end while its job is written) has its outcome written at
once instead, before the answer: the 202 carries the final job, its polls are
answered from memory, and nothing follows it (`JobManager.finish_ended`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

from runtime.dispatch import claims
from runtime.dispatch.executor import Executor
from runtime.dispatch.streams import Streams
from runtime.dispatch.work import Work
from runtime.jobs.job import Job, JobStatus
from runtime.jobs.manager import JobManager
from runtime.models.cache import ModelCache
from runtime.registry import HandlerSpec
from runtime.telemetry.metrics import HandlerStats


class Recorder:
    """Records the dispatcher's work as jobs, and follows what is left to run."""

    def __init__(
        self,
        jobs: JobManager,
        streams: Streams,
        cache: ModelCache,
        executor: Executor,
        stats: Callable[[str], HandlerStats],
        busy: Callable[[HandlerSpec], bool],
    ) -> None:
        """`busy(spec)`: whether `spec` is at its declared concurrency (claims.waits)."""
        self.busy = busy
        self.jobs = jobs
        self.streams = streams
        self.cache = cache
        self.executor = executor
        self.stats = stats

    async def submit(
        self,
        spec: HandlerSpec,
        event: Any,
        work: Work,
        key_id: str | None,
        start: Callable[[Work, Any], object],
    ) -> Job:
        """`work`, not started yet, as a job: recorded, then `start`ed and followed."""
        queued = self.jobs.shared_queue and claims.waits(
            spec, self.executor, self.cache, self.busy(spec)
        )
        job = await self.record(spec, event, work, key_id, queued=queued)
        if not queued:
            start(work, event)
            return await self.follow(spec, job, work)
        # Held before it starts: its claim may be made in the start's first step (its
        # models turned ready while the record was written), and must find it here.
        work.claim = partial(claims.claim_job, self.jobs, self.streams, job.id, work)
        followed = await self.follow(spec, job, work)
        start(work, event)
        return followed

    async def turn_into_job(
        self, spec: HandlerSpec, event: Any, work: Work, key_id: str | None, queued: bool
    ) -> Job:
        """`work`, started and not ended, as a job (its caller's deadline came): recorded
        and followed. `queued`: it still waits for capacity, and is recorded queued
        for the fleet, claimed by id before it runs (claims.claim_recorded)."""
        if not queued:
            return await self.follow(spec, await self.record(spec, event, work, key_id), work)
        recorded: asyncio.Future[Job | None] = asyncio.get_running_loop().create_future()
        work.claim = partial(claims.claim_recorded, self.jobs, self.streams, recorded, work)
        try:
            job = await self.record(spec, event, work, key_id, queued=True)
        except BaseException:
            recorded.set_result(None)  # not recorded: nobody else can take it
            raise
        recorded.set_result(job)
        return await self.follow(spec, job, work)

    async def record(
        self, spec: HandlerSpec, event: Any, work: Work, key_id: str | None, queued: bool = False
    ) -> Job:
        """`work`'s job, durable."""
        job = await self.jobs.record(
            spec.name, event, phase=work.phase, key_id=key_id, queued=queued
        )
        self.stats(spec.name).count("async")
        return job

    async def follow(self, spec: HandlerSpec, job: Job, work: Work) -> Job:
        """Follow the job of `work`: lease, phases, outcome; the job as answered (final,
        if the work has ended and its outcome is written at once)."""
        if work.outcome.done() and (final := await self.jobs.finish_ended(job, work.outcome)):
            return final
        self.jobs.follow(
            job, work.outcome, lambda: (work.phase, self.progress(spec, work)), items=work.stream
        )
        # Each change of phase is written as it happens (runtime/jobs/leases.py).
        work.on_phase = partial(self.jobs.phase_changed, job.id)
        if work.stream is not None and job.status is not JobStatus.QUEUED:  # else on its claim
            self.streams.hold(job.id, work.stream)
        return job

    def progress(self, spec: HandlerSpec, work: Work | None = None) -> dict[str, Any] | None:
        """What a job shows while it runs: a stream's items so far, or its load's bytes."""
        if work is not None and work.running and work.stream is not None:
            return work.stream.partial()
        for name in spec.uses:
            entry = self.cache.entries.get(name)
            if entry is not None and entry.lifecycle.loading and entry.manifest is not None:
                return {
                    "bundle": name,
                    "state": str(entry.lifecycle.state),
                    "bytes": entry.progress_bytes,
                    "total_bytes": entry.manifest.total_bytes,
                }
        return None

"""Group commit for job creation: the 202 path's one durable write.

A 202 may only be sent once its job is stored, and under a burst (64 callers
hitting a cold bundle at once) one write per request queues 64 transactions
and 64 thread hand-offs behind each other. Instead, the first creation starts
a write at once, creations arriving while it is in flight wait for the next
one, and each write stores everything waiting in one `create_many` call (one
transaction on SQLite). A lone request pays one write; a burst pays a few
writes, not one per job. A lone request's write runs on the loop when the
store can run it there at once (`JobStore.now`), with no thread hop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import orjson

from runtime.errors import Conflict
from runtime.jobs.job import Job
from runtime.jobs.stores.not_now import NotNow

CreateMany = Callable[[Sequence[Job]], list[Conflict | None]]
Now = Callable[..., Any]  # JobStore.now


class GroupCommit:
    """Job creations stored together: one write for all that arrive while one is in flight."""

    def __init__(self, create_many: CreateMany, now: Now | None = None) -> None:
        self._create_many = create_many
        self._now = now
        self._waiting: list[tuple[Job, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def create(self, job: Job, encoded_input: bytes | None = None) -> None:
        """Store `job`; returns once it is durable (raises Conflict for a used id).

        `encoded_input`: the job's input as JSON already (its quota counted it), which
        the store writes as it is: one serialization of an input, not two (a few ms
        per MB). The job holds its input's value again once this returns."""
        event = job.input
        if encoded_input is not None:
            job.input = orjson.Fragment(encoded_input)
        try:
            if self._writer is None and self._now is not None:  # alone: at once if it can be
                made = self._now(partial(self._create_many, [job]), writes=True)
                if not isinstance(made, NotNow):
                    if made[0] is not None:
                        raise made[0]
                    return
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append((job, done))
            if self._writer is None:
                self._writer = asyncio.get_running_loop().create_task(self._write())
            await done
        finally:
            job.input = event

    async def _write(self) -> None:
        try:
            while self._waiting:
                group, self._waiting = self._waiting, []
                await self._write_group(group)
        finally:
            self._writer = None

    async def _write_group(self, group: list[tuple[Job, asyncio.Future[None]]]) -> None:
        try:
            outcomes = await asyncio.to_thread(self._create_many, [job for job, _ in group])
        except Exception as exc:  # the store failed: every job of the group reports it
            _resolve(group, [exc] * len(group))
        except BaseException:
            for _, done in group:
                done.cancel()
            raise
        else:
            _resolve(group, outcomes)


def _resolve(group: list[tuple[Job, asyncio.Future[None]]], outcomes: Sequence[Any]) -> None:
    for (_, done), outcome in zip(group, outcomes, strict=True):
        if done.done():  # its caller gave up (cancelled)
            continue
        if outcome is None:
            done.set_result(None)
        else:
            done.set_exception(outcome)

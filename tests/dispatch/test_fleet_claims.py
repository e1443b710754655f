"""Work a handler's capacity holds back is the fleet's (runtime/dispatch/claims.py).

One instance in-process on a real PostgreSQL job store (a fleet's), serving
`one_at_a_time` (tests/handlers/one_at_a_time.py: max_concurrent=1, each run
held until the test ends it). While a call runs, a job submitted is recorded
queued, for any instance to claim, and so is the job of a sync caller answered
202 at its deadline while its batch member waits; as each batch is about to
run, this instance claims its member's job by id (taking back what nobody else
took), so every job runs once, here, one at a time.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.dispatch.answers import JOB_NOW
from runtime.jobs.job import JobStatus
from tests.handlers.one_at_a_time import RUNS
from tests.inproc import until
from tests.jobs import postgres_fixtures
from tests.support import SAFETY_S, make_bundle, running_instance, settings_for

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        importlib.util.find_spec("psycopg") is None, reason="needs psycopg (the postgres extra)"
    ),
]
postgres_cluster = postgres_fixtures.postgres_cluster
HANDLER = "one_at_a_time"
THREADED = "serial_threads"


@pytest.fixture
def dsn(postgres_cluster: postgres_fixtures.PostgresCluster) -> Iterator[str]:
    name = postgres_cluster.create_database()
    yield postgres_cluster.dsn(name)
    postgres_cluster.drop_database(name)


async def test_work_waiting_for_capacity_is_recorded_queued_and_taken_back_in_turn(
    dsn: str, tmp_path: Path
) -> None:
    RUNS.reset()
    settings = settings_for(
        tmp_path, job_store=dsn, handlers=("tests.handlers.one_at_a_time",), job_lease_s=600.0
    )
    async with running_instance(settings) as instance:
        await until(instance.ready, "ready")
        assert instance.jobs.shared_queue, "ready only once in its fleet"
        first = await instance.invoke(HANDLER, {"id": "job-0"}, policy=JOB_NOW, request_id="0")
        assert first.job is not None and first.job.status is JobStatus.RUNNING
        await until(lambda: RUNS.started == ["job-0"], "the first job runs")
        behind = await instance.invoke(HANDLER, {"id": "job-1"}, policy=JOB_NOW, request_id="1")
        assert behind.job is not None and behind.job.status is JobStatus.QUEUED, behind
        sync = await instance.invoke(HANDLER, {"id": "sync"}, wait_s=0.5, request_id="s")
        assert sync.job is not None and sync.job.status is JobStatus.QUEUED, sync
        assert RUNS.started == ["job-0"], "nothing started beside the running call"

        for expected in ("job-1", "sync"):
            [running] = RUNS.open
            RUNS.finish(running)
            await until(lambda e=expected: RUNS.started[-1:] == [e], f"{expected} runs")
        RUNS.finish_all()
        for job in (first.job, behind.job, sync.job):
            done = await instance.jobs.get(job.id, key_id=None, wait_s=SAFETY_S)
            assert done.status is JobStatus.SUCCEEDED, done
            assert done.attempts == 1
        assert RUNS.started == ["job-0", "job-1", "sync"] and RUNS.peak == 1


async def test_a_job_whose_model_turns_ready_while_it_is_recorded_queued_runs_here_once(
    dsn: str, tmp_path: Path
) -> None:
    """Recorded queued because its model was loading; the load ends while the record is
    being written. Its work then starts at once, claiming the job in its first step,
    and the job must be held here by then: it runs now, once. (It was cancelled, and
    left queued until an idle instance of the fleet took it: this one never is
    idle here, a call of `one_at_a_time` runs throughout.)

    The order is the test's: the job table is locked from another connection, so the
    record's INSERT waits in its thread until the load has ended."""
    import psycopg

    from tests.handlers import held

    make_bundle(tmp_path / "bundles", "held")
    held.BUILD_GATE.clear()
    held.BUILDING.clear()
    RUNS.reset()
    settings = settings_for(
        tmp_path,
        job_store=dsn,
        handlers=("tests.handlers.held", "tests.handlers.one_at_a_time"),
        job_lease_s=600.0,
    )
    async with running_instance(settings) as instance:
        await until(instance.ready, "ready")
        busy = asyncio.ensure_future(
            instance.invoke(HANDLER, {"id": "busy"}, wait_s=SAFETY_S, request_id="b")
        )
        await until(lambda: RUNS.started == ["busy"], "a call runs throughout")
        try:
            waiter = asyncio.ensure_future(
                instance.invoke("held_async", {"n": 0}, wait_s=SAFETY_S, request_id="w")
            )
            locker = await asyncio.to_thread(psycopg.connect, dsn)
            watcher = await asyncio.to_thread(psycopg.connect, dsn, autocommit=True)
            try:
                await until(held.BUILDING.is_set, "the load waits at its gate")
                await asyncio.to_thread(locker.execute, "LOCK TABLE thaw_jobs IN EXCLUSIVE MODE")
                submitted = asyncio.ensure_future(
                    instance.invoke("held_async", {"n": 1}, policy=JOB_NOW, request_id="j")
                )

                def inserts_waiting() -> bool:
                    row = watcher.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE '%INSERT INTO thaw_jobs%'"
                    ).fetchone()
                    return row is not None and row[0] > 0

                await until(inserts_waiting, "the record waits for the lock", in_thread=True)
                assert not submitted.done()
                held.BUILD_GATE.set()
                await until(lambda: instance.cache.is_ready("held"), "the model is ready")
            finally:
                held.BUILD_GATE.set()
                await asyncio.to_thread(locker.rollback)  # the record is written now
                await asyncio.to_thread(locker.close)
                await asyncio.to_thread(watcher.close)
            assert (await waiter).output == {"tensors": 1, "event": {"n": 0}}
            answer = await submitted
            assert answer.job is not None and answer.job.status is JobStatus.QUEUED, answer
            done = await instance.jobs.get(answer.job.id, key_id=None, wait_s=SAFETY_S)
            assert done.status is JobStatus.SUCCEEDED and done.attempts == 1, done
            assert done.output == {"tensors": 1, "event": {"n": 1}}
            assert RUNS.started == ["busy"] and not busy.done(), "it ran beside the busy call"
        finally:
            RUNS.finish_all()
        assert (await busy).output == {"id": "busy"}


async def test_a_sequence_waiting_for_a_decode_slot_is_queued_and_claimed_as_it_gets_one(
    dsn: str, tmp_path: Path
) -> None:
    from tests.handlers import stepped

    gate = stepped.GATES["fleet-claims"]
    gate.clear()
    settings = settings_for(
        tmp_path, job_store=dsn, handlers=("tests.handlers.stepped",), job_lease_s=600.0
    )
    async with running_instance(settings) as instance:
        await until(instance.ready, "ready")
        decoder = instance.dispatcher.decoder
        held = [
            asyncio.ensure_future(
                instance.invoke(
                    "stepped",
                    {"name": f"held{i}", "n": 2, "hold_at": 1, "gate": "fleet-claims"},
                    wait_s=SAFETY_S,
                    request_id=f"held{i}",
                )
            )
            for i in range(3)
        ]
        try:
            await until(lambda: decoder.busy("stepped"), "every slot taken")
            queued = await instance.invoke(
                "stepped", {"name": "queued", "n": 2}, policy=JOB_NOW, request_id="q"
            )
            assert queued.job is not None and queued.job.status is JobStatus.QUEUED, queued
        finally:
            gate.set()
        for i, call in enumerate(held):
            assert (await call).output == [f"held{i}:0", f"held{i}:1"]
        done = await instance.jobs.get(queued.job.id, key_id=None, wait_s=SAFETY_S)
        assert done.status is JobStatus.SUCCEEDED and done.attempts == 1, done
        assert done.output == ["queued:0", "queued:1"]


async def wait_for(event: threading.Event, what: str) -> None:
    if not await asyncio.to_thread(event.wait, SAFETY_S):
        raise AssertionError(f"never: {what}")


@pytest.mark.parametrize("taken_by", ["this instance", "another instance"])
async def test_a_sync_202_waiting_for_a_handler_thread_is_queued_and_runs_once(
    dsn: str, tmp_path: Path, taken_by: str
) -> None:
    """A plain sync handler on one handler thread: a sync caller's deadline comes while
    its call waits for the thread, so its job is recorded queued (the fleet's), and
    its call, gated, claims the job as the thread takes it. Whoever claims first
    runs it: this instance once the thread frees, or another that took it meanwhile
    (this one then discards its call unrun)."""
    from tests.handlers.serial_threads import RUNS

    RUNS.reset()
    handlers = ("tests.handlers.serial_threads",)
    settings = settings_for(
        tmp_path, job_store=dsn, handlers=handlers, job_lease_s=600.0, handler_threads=1
    )
    async with running_instance(settings) as instance:
        await until(instance.ready, "ready")
        held = asyncio.ensure_future(
            instance.invoke(
                THREADED, {"tag": "held", "gate": "held"}, wait_s=SAFETY_S, request_id="h"
            )
        )
        await wait_for(RUNS.begun("held"), "the held call runs on the one thread")
        sync = await instance.invoke(THREADED, {"tag": "sync"}, wait_s=0.2, request_id="s")
        assert sync.job is not None and sync.job.status is JobStatus.QUEUED, sync
        row = await asyncio.to_thread(instance.jobs.store.get, sync.job.id)
        assert row is not None and row.status is JobStatus.QUEUED, row
        assert RUNS.started == ["held"], "nothing started beside the running call"

        if taken_by == "another instance":
            other_root = tmp_path / "other"
            other = settings_for(other_root, job_store=dsn, handlers=handlers, handler_threads=1)
            async with running_instance(other) as idle:
                await until(idle.ready, "the other instance ready")
                done = await idle.jobs.get(sync.job.id, key_id=None, wait_s=SAFETY_S)
                assert done.status is JobStatus.SUCCEEDED, done
                assert RUNS.started == ["held", "sync"]
                RUNS.gate("held").set()  # this instance's thread frees: its claim loses
                assert (await held).output["tag"] == "held"
                await instance.dispatcher.workload.quiet_by(None)
        else:
            RUNS.gate("held").set()
            assert (await held).output["tag"] == "held"
            done = await instance.jobs.get(sync.job.id, key_id=None, wait_s=SAFETY_S)
            assert done.status is JobStatus.SUCCEEDED, done
        assert done.attempts == 1 and done.output["tag"] == "sync", done
        assert RUNS.started == ["held", "sync"], "once, fleet-wide"
        # This instance's one thread ran the held call, and the 202'd call only if it won.
        here = RUNS.ran_on["sync"] is RUNS.ran_on["held"]
        assert here is (taken_by == "this instance"), RUNS.ran_on
        if here:
            assert RUNS.peak == 1
        final = await instance.jobs.get(sync.job.id, key_id=None)
        assert final.status is JobStatus.SUCCEEDED and final.output == done.output, final

"""Any instance answers any job, and the fleet outlives its instances:

- a long poll on one instance wakes when the job finishes on another, by the
  database's notification (shown in-process on a ManualClock that never moves,
  so no timer could have woken it);
- a cancel that reaches another instance stops the running work, long before
  any lease or heartbeat could have told its owner (leases of 600 s), even one
  committed before the owner's listening session listened;
- an instance SIGKILLed has its running job taken over by another, found dead
  by its silence in the database, long before its lease lapses; a living
  instance's job that runs longer than that silence is never taken.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from runtime.clock import ManualClock
from runtime.jobs.job import Job, JobStatus, new_job_id
from runtime.jobs.manager import JobManager
from runtime.jobs.stores.postgres import PostgresJobStore
from runtime.jobs.wakeups import Event
from runtime.telemetry.metrics import Metrics
from tests.fleet.conftest import MakeFleet
from tests.inproc import until as until_async
from tests.support import SAFETY_S, until

# Far longer than any test waits: only the fleet's own signals can explain what happens.
LEASE_S = "600"
# A wait's safety limit ends before the first heartbeat (a third of a lease) or a
# lapsed lease could have told anyone anything.
assert float(LEASE_S) / 3 > SAFETY_S


class ReadsCounted(PostgresJobStore):
    """A store that counts the reads of a job that have returned."""

    reads = 0

    def get(self, job_id: str) -> Job | None:
        try:
            return super().get(job_id)
        finally:
            self.reads += 1


async def turns(n: int = 5) -> None:
    """Let the loop run what is ready (a woken waiter resumes in the next turn)."""
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.anyio
async def test_a_long_poll_wakes_on_the_notification_of_another_instances_write(
    fleet_dsn: str,
) -> None:
    clock = ManualClock()  # never advanced: no timer can wake anything
    here = ReadsCounted(fleet_dsn, ttl_s=3600, clock=clock)
    there = PostgresJobStore(fleet_dsn, ttl_s=3600, clock=clock)
    manager = JobManager(
        here, owner="here", lease_s=30, max_attempts=3, metrics=Metrics(), clock=clock
    )
    try:
        heard: list[Event | None] = []
        manager.wakeups.subscribe(heard.append)
        manager.wakeups.start(here)
        assert await asyncio.to_thread(here._listeners[0].listening.wait, 30)
        job = Job(id=new_job_id(), handler="echo", input={"x": 1})
        await asyncio.to_thread(there.create, job)
        await until_async(lambda: any(e and e.job_id == job.id for e in heard), "the create heard")
        poll = asyncio.ensure_future(manager.get(job.id, key_id=None, wait_s=60))
        await until_async(lambda: here.reads == 1, "the poll's first read")
        assert await asyncio.to_thread(there.claim, job.id, "there", 30, 3) is not None
        # The claim's notification wakes the poll, which reads the job again: running.
        await until_async(lambda: here.reads == 2, "the poll's read on the claim")
        await turns()
        assert not poll.done()  # running is not final: the poll waits on
        assert await asyncio.to_thread(there.finish, job.id, "there", JobStatus.SUCCEEDED, {"y": 2})
        found = await asyncio.wait_for(poll, 30)
        assert (found.status, found.output) == (JobStatus.SUCCEEDED, {"y": 2})
    finally:
        manager.wakeups.close()
        manager.close()
        here.close()
        there.close()


def tick_log(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_cancel_on_another_instance_stops_the_work_at_once(
    make_fleet: MakeFleet, tmp_path: Path
) -> None:
    ticks = tmp_path / "ticks.log"
    fleet = make_fleet(2, THAW_JOB_LEASE_S=LEASE_S, THAW_TEST_TICK_LOG=str(ticks))
    owner, other = fleet.instances
    with owner.client() as here, other.client() as there:
        job_id = (
            here.post("/handlers/ticks/jobs", json={"n": 100000, "gap_s": 0.01})
            .raise_for_status()
            .json()["id"]
        )
        until(lambda: "tick 0" in tick_log(ticks), "the job to run")
        cancelled = there.delete(f"/jobs/{job_id}").raise_for_status().json()
        assert cancelled["status"] == "cancelled"
        # The owner heard the notification: its generator is closed, not run on
        # to its next heartbeat (a third of a 600 s lease away).
        ended = until(
            lambda: [line for line in tick_log(ticks) if line.startswith("end ")],
            "the work to stop",
        )
        assert ended[0].endswith(" closed")
        for client in (here, there):
            assert client.get(f"/jobs/{job_id}").json()["status"] == "cancelled"


def test_a_killed_instances_job_is_taken_over_and_a_living_ones_never(
    make_fleet: MakeFleet, tmp_path: Path
) -> None:
    ticks = tmp_path / "ticks.log"
    hold = tmp_path / "hold"
    hold.touch()
    fleet = make_fleet(3, THAW_JOB_LEASE_S=LEASE_S, THAW_TEST_TICK_LOG=str(ticks))
    victim, survivor, _ = fleet.instances
    with victim.client() as direct:
        held_id = (
            direct.post("/handlers/ticks/jobs", json={"n": 3, "hold": str(hold), "hold_at": 1})
            .raise_for_status()
            .json()["id"]
        )
    with survivor.client() as direct:
        # Runs for longer than an owner's silence is allowed to last (5 s), on a
        # living instance: it must finish where it started, once.
        alive_id = (
            direct.post("/handlers/sleepy/jobs", json={"s": 8}).raise_for_status().json()["id"]
        )
    until(lambda: "tick 0" in tick_log(ticks), "the held job to start")
    fleet.kill(0)
    hold.unlink()  # the run that takes over goes through
    with fleet.client() as client:
        taken = until(
            lambda: (
                (b := client.get(f"/jobs/{held_id}?wait=5").json())["status"] == "succeeded" and b
            ),
            "the killed instance's job to finish elsewhere",
        )
        alive = client.get(f"/jobs/{alive_id}?wait=30").json()
    assert taken["attempts"] == 2
    assert taken["output"] == {"text": "t0 t1 t2 ", "ticks": 3}
    assert (alive["status"], alive["attempts"]) == ("succeeded", 1)
    assert alive["output"]["pid"] == survivor.proc.pid  # type: ignore[union-attr]
    assert "silent in the database" in survivor.log() + fleet.instances[2].log()


def test_a_follower_on_another_instance_gets_the_streamed_jobs_result(
    make_fleet: MakeFleet, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    fleet = make_fleet(2)
    owner, other = fleet.instances
    with owner.client() as here:
        job_id = (
            here.post("/handlers/ticks/jobs", json={"n": 4, "hold": str(hold), "hold_at": 2})
            .raise_for_status()
            .json()["id"]
        )
    events: list[str] = []
    with (
        other.client() as there,
        there.stream(
            "GET", f"/jobs/{job_id}", headers={"Accept": "text/event-stream", "Last-Event-ID": "0"}
        ) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(":") and hold.exists():
                hold.unlink()  # following: let the job end
            events.append(line)
            if line.startswith("data:") and "event: result" in events[-2:-1]:
                break
    assert "event: result" in events
    result = events[events.index("event: result") + 1]
    assert result == 'data: {"text":"t0 t1 t2 t3 ","ticks":4}'


def owner_on(dsn: str, clock: ManualClock) -> tuple[PostgresJobStore, JobManager]:
    """An instance's store and job manager, in-process, on `clock`."""
    store = PostgresJobStore(dsn, ttl_s=3600, clock=clock)
    manager = JobManager(
        store, owner="here", lease_s=30, max_attempts=3, metrics=Metrics(), clock=clock
    )
    return store, manager


async def stopped(work: asyncio.Future[object]) -> None:
    """Wait until the owner cancelled `work` (a safety limit, not a bound on time)."""
    for _ in range(int(SAFETY_S * 100)):
        if work.cancelled():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the held job's work was never stopped")


@pytest.mark.anyio
async def test_a_cancel_committed_before_the_instance_listened_still_stops_the_work(
    fleet_dsn: str,
) -> None:
    """An instance takes jobs as soon as its store opens, before its listening session
    listens (a submit can beat the connect): a cancel committed elsewhere in between,
    whose notification nobody heard, stops the work once the session listens. The
    clock never moves: no heartbeat could have told the owner."""
    clock = ManualClock()  # never advanced: no heartbeat can tell the owner anything
    here, manager = owner_on(fleet_dsn, clock)
    there = PostgresJobStore(fleet_dsn, ttl_s=3600, clock=clock)
    work: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    try:
        job = await manager.record("echo", {}, phase="running", key_id=None)
        manager.follow(job, work, lambda: ("running", None))
        cancelled = await asyncio.to_thread(there.cancel, job.id)
        assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
        await turns()
        assert not work.done()  # nobody listens yet: nothing has told the owner
        manager.wakeups.start(here)
        await stopped(work)  # by the first LISTEN's re-read
    finally:
        manager.wakeups.close()
        manager.close()
        here.close()
        there.close()


@pytest.mark.anyio
async def test_a_gap_in_the_notifications_rereads_the_held_jobs(fleet_dsn: str) -> None:
    """A cancel whose notification was lost (committed while the listening session was
    away) still stops the work once the session is back: the gap makes the owner read
    its held jobs again. The clock never moves: no heartbeat could have told it."""
    import psycopg

    here, manager = owner_on(fleet_dsn, ManualClock())
    work: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    try:
        manager.wakeups.start(here)
        listener = here._listeners[0]
        assert await asyncio.to_thread(listener.listening.wait, 30)
        job = await manager.record("echo", {}, phase="running", key_id=None)
        manager.follow(job, work, lambda: ("running", None))
        with psycopg.connect(fleet_dsn, autocommit=True) as conn:
            # Cancelled behind the listeners' backs: no pg_notify.
            conn.execute(
                "UPDATE thaw_jobs SET status = 'cancelled', phase = 'cancelled' WHERE id = %s",
                (job.id,),
            )
            listener.listening.clear()
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND query IN ('LISTEN thaw_jobs', 'SELECT 1')"
            )
        assert await asyncio.to_thread(listener.listening.wait, 30)  # back: the gap
        await stopped(work)  # by the re-read
    finally:
        manager.wakeups.close()
        manager.close()
        here.close()

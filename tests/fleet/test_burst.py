"""A burst sent to one instance is the fleet's work, run within declared capacity.

Two and three real `thaw serve` instances on one PostgreSQL database behind
nginx. Every job and sync call of the burst goes to instance 0 directly, as a
client pinned to one instance (or a load balancer's unlucky spread) sends it.
The handler is declared one call at a time (tests/handlers/serial.py), and each
run logs its start and end, so the test checks from the handler's own record:

- no two runs of one instance ever overlap (declared capacity is never exceeded,
  not for sync callers near their deadline, not for jobs);
- every instance runs part of the burst, and every job runs exactly once;
- the fleet gauges count the backlog while it waits, and go back to 0.

The first run of every instance is held by a file (the handler waits while it
exists), so the moment the gauges are read is the test's, not the clock's.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.fleet.conftest import MakeFleet
from tests.fleet.harness import Fleet
from tests.fleet.test_fleet import metric_lines
from tests.handlers.serial import overlaps, runs
from tests.support import until

LEASE_S = "600"


def queued(client: httpx.Client, handler: str) -> float:
    text = client.get("/metrics").raise_for_status().text
    return metric_lines(text, "thaw_fleet_jobs_queued").get(f'{{handler="{handler}"}}', 0.0)


def sync_202s(client: httpx.Client, handler: str) -> list[str]:
    """Two sync callers who cannot wait for a handler at capacity everywhere: each
    gets a 202 job before its deadline (the jobs join the backlog); their ids."""
    sync = [
        client.post(
            f"/invoke/{handler}", json={"tag": f"sync{n}", "s": 0.05}, headers={"Prefer": "wait=1"}
        )
        for n in range(2)
    ]
    assert [r.status_code for r in sync] == [202, 202], [r.text for r in sync]
    return [r.json()["id"] for r in sync]


def gauge_counts(
    fleet: Fleet, handler: str, count: int, first: httpx.Client, ids: list[str]
) -> None:
    """Until the fleet gauge of `handler` reads `count` (failing with what it read and
    each job's status)."""
    with fleet.client() as anywhere:
        try:
            until(lambda: queued(anywhere, handler) == count, f"the fleet gauge to count {count}")
        except AssertionError as exc:
            read = queued(anywhere, handler)
            raise AssertionError(f"{exc}: it reads {read}; {statuses(first, ids)}") from exc


def statuses(client: httpx.Client, ids: list[str]) -> list[object]:
    return [client.get(f"/jobs/{job_id}").json().get("status") for job_id in ids]


def final(client: httpx.Client, job_id: str) -> dict[str, object]:
    body: dict[str, object] = (
        client.get(f"/jobs/{job_id}", params={"wait": 60}).raise_for_status().json()
    )
    while body["status"] in ("queued", "running"):
        body = client.get(f"/jobs/{job_id}", params={"wait": 60}).raise_for_status().json()
    return body


@pytest.mark.parametrize(("instances", "jobs"), [(2, 6), (3, 9)])
def test_a_burst_to_one_instance_is_shared_by_the_fleet_within_capacity(
    make_fleet: MakeFleet, tmp_path: Path, instances: int, jobs: int
) -> None:
    log, hold = tmp_path / "runs.log", tmp_path / "hold"
    fleet = make_fleet(
        instances,
        THAW_HANDLERS="tests.handlers.serial",
        THAW_JOB_LEASE_S=LEASE_S,
        THAW_TEST_RUN_LOG=str(log),
    )
    for server in fleet.instances:
        # Ready once it has joined the fleet: before, it records no job queued.
        with server.client() as direct:
            until(lambda: direct.get("/readyz").status_code == 200, "the instance to be ready")
    hold.touch()
    with fleet.instances[0].client() as first:
        ids = [
            first.post(
                "/handlers/serial/jobs", json={"tag": f"job{n}", "hold": str(hold), "s": 0.05}
            )
            .raise_for_status()
            .json()["id"]
            for n in range(jobs)
        ]
        # Every instance takes one job of the burst, and holds it while the file exists.
        until(
            lambda: len({run.pid for run in runs(log)}) == instances,
            f"each of the {instances} instances to start a run of the burst",
        )
        assert len(runs(log)) == instances, runs(log)  # one each: capacity 1
        sync = sync_202s(first, "serial")
        ids += sync
        gauge_counts(fleet, "serial", jobs - instances + len(sync), first, ids)
        assert len(runs(log)) == instances  # nothing started beside the held runs

        hold.unlink()
        done = [final(first, job_id) for job_id in ids]
        assert [job["status"] for job in done] == ["succeeded"] * len(ids), done
        with fleet.client() as anywhere:
            until(lambda: queued(anywhere, "serial") == 0, "the fleet gauge to return to 0")

    record = runs(log)
    tags = sorted(run.tag for run in record)
    assert tags == sorted([f"job{n}" for n in range(jobs)] + ["sync0", "sync1"]), record
    assert overlaps(log) == [], overlaps(log)
    assert {run.pid for run in record} == {
        server.proc.pid for server in fleet.instances if server.proc is not None
    }


def test_a_burst_to_a_sync_handler_on_one_thread_is_shared_within_capacity(
    make_fleet: MakeFleet, tmp_path: Path
) -> None:
    """A plain sync handler, unbatched, on instances of one handler thread each
    (THAW_HANDLER_THREADS=1: the thread limit is its capacity). Jobs behind the
    busy thread, and sync callers answered 202 while their calls wait for it, are
    the fleet's: each runs once, on whichever instance claims it, never two at once
    on one instance."""
    log, hold = tmp_path / "runs.log", tmp_path / "hold"
    fleet = make_fleet(
        2,
        THAW_HANDLERS="tests.handlers.serial_threads",
        THAW_HANDLER_THREADS="1",
        THAW_JOB_LEASE_S=LEASE_S,
        THAW_TEST_RUN_LOG=str(log),
    )
    for server in fleet.instances:
        with server.client() as direct:
            until(lambda: direct.get("/readyz").status_code == 200, "the instance to be ready")

    hold.touch()
    with fleet.instances[0].client() as first:
        ids = [
            first.post(
                "/handlers/serial_threads/jobs",
                json={"tag": f"job{n}", "hold": str(hold), "s": 0.05},
            )
            .raise_for_status()
            .json()["id"]
            for n in range(4)
        ]
        until(lambda: len({run.pid for run in runs(log)}) == 2, "each instance to start a run")
        assert len(runs(log)) == 2, runs(log)  # one each: one thread
        ids += sync_202s(first, "serial_threads")
        gauge_counts(fleet, "serial_threads", 4, first, ids)  # 2 jobs + 2 sync 202s
        assert len(runs(log)) == 2  # nothing started beside the held runs

        hold.unlink()
        done = [final(first, job_id) for job_id in ids]
        assert [job["status"] for job in done] == ["succeeded"] * len(ids), done
        assert [job["attempts"] for job in done] == [1] * len(ids), done
        with fleet.client() as anywhere:
            until(lambda: queued(anywhere, "serial_threads") == 0, "the fleet gauge to return to 0")

    record = runs(log)
    tags = sorted(run.tag for run in record)
    assert tags == sorted([f"job{n}" for n in range(4)] + ["sync0", "sync1"]), record
    assert overlaps(log) == [], overlaps(log)
    assert {run.pid for run in record} == {
        server.proc.pid for server in fleet.instances if server.proc is not None
    }

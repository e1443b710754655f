"""The fleet's chaos in short, in order rather than at random (bench/fleet.py chaos
is the long, random one, with its figures in BENCHMARKS.md; docs/reliability.md): three instances
behind nginx on one PostgreSQL of the test's own, nine held jobs spread over
them, two instances SIGKILLed one after the other and replaced by new ones (a
fresh state directory each, as on another machine), PostgreSQL restarted, then
the jobs let go. Every accepted job ends succeeded, none is ever answered 404,
and no job runs again once its output is recorded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fleet.harness import Fleet, nginx_binary
from tests.handlers.runlog import runs
from tests.jobs import postgres_fixtures
from tests.support import until


@pytest.fixture
def own_cluster() -> Iterator[postgres_fixtures.PostgresCluster]:
    """A cluster of this test's own: it restarts it."""
    cluster = postgres_fixtures.started_cluster()
    yield cluster
    cluster.remove()


@pytest.fixture
def chaos_fleet(
    own_cluster: postgres_fixtures.PostgresCluster, thaw_env: dict[str, str], tmp_path: Path
) -> Iterator[Fleet]:
    binary = nginx_binary()
    if binary is None:
        pytest.skip("no nginx binary (apt-get install nginx; .ci/run does)")
    env = {
        **thaw_env,
        "THAW_HANDLERS": "tests.handlers.runlog",
        "THAW_TEST_RUN_LOG": str(tmp_path / "runs.log"),
        "THAW_JOB_LEASE_S": "600",
        "THAW_JOB_MAX_ATTEMPTS": "10",
    }
    dsn = own_cluster.dsn(own_cluster.create_database())
    fleet = Fleet(binary, env, dsn, tmp_path / "fleet", 3)
    yield fleet
    fleet.stop()


def alive_pids(fleet: Fleet) -> set[int]:
    return {s.proc.pid for s in fleet.instances if s.proc is not None and s.proc.poll() is None}


def test_kills_and_a_database_restart_lose_and_recompute_nothing(
    chaos_fleet: Fleet, own_cluster: postgres_fixtures.PostgresCluster, tmp_path: Path
) -> None:
    fleet, log, hold = chaos_fleet, tmp_path / "runs.log", tmp_path / "hold"
    hold.touch()
    tags = [f"j{n}" for n in range(9)]
    with fleet.client() as client:
        ids = {
            tag: client.post("/handlers/logged/jobs", json={"tag": tag, "hold": str(hold)})
            .raise_for_status()
            .json()["id"]
            for tag in tags
        }

    def every_job_runs_on_a_living_instance() -> bool:
        living = alive_pids(fleet)
        return all(any(pid in living for pid, _ in runs(log, tag)) for tag in tags)

    until(every_job_runs_on_a_living_instance, "every job to run")
    first_pids = {pid for tag in tags for pid, _ in runs(log, tag)}
    assert len(first_pids) == 3  # nginx spread them over the three
    for index in (0, 1):
        fleet.kill(index)
        fleet.restart(index, fresh=True)
        until(every_job_runs_on_a_living_instance, f"kill {index + 1}'s jobs to run elsewhere")
    own_cluster.restart("fast")
    hold.unlink()
    not_found = 0
    final: dict[str, dict[str, Any]] = {}

    def every_job_final() -> bool:
        nonlocal not_found
        with httpx.Client(base_url=fleet.url, timeout=30) as client:
            for tag, job_id in ids.items():
                if tag in final:
                    continue
                response = client.get(f"/jobs/{job_id}?wait=2")
                not_found += response.status_code == 404
                if response.status_code == 200 and response.json()["status"] == "succeeded":
                    final[tag] = response.json()
        return len(final) == len(ids)

    until(every_job_final, "every job to finish")
    assert not_found == 0
    for tag, body in final.items():
        recorded = body["output"]["started"]
        assert [start for _, start in runs(log, tag) if start > recorded] == [], tag
        assert body["attempts"] == len(runs(log, tag))
    # The two killed instances' jobs ran again: more runs than jobs.
    assert sum(len(runs(log, tag)) for tag in tags) > len(tags)

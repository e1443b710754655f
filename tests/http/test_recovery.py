"""Recovery after `kill -9` on the same node does not wait for the lease; and chaos.

Real servers share a state dir and a SQLite file, with a 600 s lease: a job
orphaned by a killed server is run again by the next server started there as
soon as it starts (its owner's lock file is unlocked: provably dead), while its
first lease is still far in the future; a job that had finished is never run
again, and a job of a server that is still alive is left to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from bench.experiments import chaos
from runtime.jobs.stores.sqlite import SQLiteJobStore
from tests.handlers.runlog import runs
from tests.support import ServerProcess, until

LEASE_S = "600"


def epoch(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def test_a_job_orphaned_by_kill_9_is_run_again_at_once_by_the_next_server(
    serve: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    run_log = tmp_path / "runs.log"
    env = {
        "THAW_HANDLERS": "tests.handlers.runlog",
        "THAW_TEST_RUN_LOG": str(run_log),
        "THAW_JOB_LEASE_S": LEASE_S,
    }
    orphan_hold, sibling_hold = tmp_path / "hold-orphan", tmp_path / "hold-sibling"
    orphan_hold.touch()
    sibling_hold.touch()

    doomed = serve(**env)
    sibling = serve(**env)  # alive on the same node throughout
    with doomed.client() as client:
        done = client.post("/handlers/logged/jobs", json={"tag": "done"}).json()
        finished = client.get(f"/jobs/{done['id']}", params={"wait": 30}).json()
        assert finished["status"] == "succeeded"
        orphan = client.post(
            "/handlers/logged/jobs", json={"tag": "orphan", "hold": str(orphan_hold)}
        )
        orphan_id = orphan.json()["id"]
    with sibling.client() as client:
        theirs_id = client.post(
            "/handlers/logged/jobs", json={"tag": "sibling", "hold": str(sibling_hold)}
        ).json()["id"]
    until(lambda: runs(run_log, "orphan") and runs(run_log, "sibling"), "both jobs started")

    store = SQLiteJobStore(Path(doomed.env["THAW_JOB_STORE"][len("sqlite:///") :]), ttl_s=3600)
    try:
        first = store.get(orphan_id)
        assert first is not None and first.lease_until is not None
        first_lease_until = first.lease_until

        doomed.kill()  # SIGKILL mid-job: no chance to clean up or to hand anything over
        orphan_hold.unlink()
        heir = serve(**env)
        assert heir.proc is not None
        with heir.client() as client:
            recovered = client.get(f"/jobs/{orphan_id}", params={"wait": 30}).json()
            assert recovered["status"] == "succeeded", recovered
            assert recovered["attempts"] == 2
            assert recovered["output"]["pid"] == heir.proc.pid
            # Taken because its owner was dead, not because its lease ran out.
            assert epoch(recovered["updated_at"]) < first_lease_until
            assert time.time() < first_lease_until

            # The finished job kept its output and was not run again.
            kept = client.get(f"/jobs/{done['id']}").json()
            assert kept["status"] == "succeeded" and kept["output"] == finished["output"]
            # The living sibling's job is still its own.
            theirs = store.get(theirs_id)
            assert theirs is not None and theirs.status.value == "running"
            assert theirs.attempts == 1 and theirs.owner is not None

        sibling_hold.unlink()
        with sibling.client() as client:
            final = client.get(f"/jobs/{theirs_id}", params={"wait": 30}).json()
            assert final["status"] == "succeeded" and final["attempts"] == 1
            assert final["output"]["pid"] == sibling.proc.pid  # type: ignore[union-attr]
    finally:
        store.close()

    assert len(runs(run_log, "done")) == 1
    assert [pid for pid, _ in runs(run_log, "orphan")] == [
        doomed.proc.pid,  # type: ignore[union-attr]
        heir.proc.pid,
    ]
    assert len(runs(run_log, "sibling")) == 1
    # The dead owner's lock file is gone; the living ones hold theirs.
    owners = Path(doomed.env["THAW_STATE_DIR"]) / "owners"
    assert len(list(owners.glob("*.lock"))) == 2
    assert "died on this node" in heir.log_path.read_text()


def test_a_clean_stop_leaves_no_dead_owner_behind(
    serve: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    server = serve(THAW_HANDLERS="tests.handlers.runlog", THAW_JOB_LEASE_S=LEASE_S)
    owners = Path(server.env["THAW_STATE_DIR"]) / "owners"
    until(lambda: list(owners.glob("*.lock")), "the owner lock taken")
    assert server.terminate() == 0
    assert list(owners.glob("*.lock")) == []


@pytest.mark.slow
def test_chaos_kill_9_at_random_points_loses_and_recomputes_nothing(tmp_path: Path) -> None:
    """bench/experiments/chaos.py, 30 cycles: fast, slow and failing jobs and sync calls against
    a server SIGKILLed at random points and restarted; then every job is final."""
    config = chaos.Config(cycles=30, seed=15, min_uptime_s=0.3, max_uptime_s=1.2, clients=2)
    figures = chaos.run(config, tmp_path)
    report = chaos.render(config, figures)
    assert figures.cycles == 30, report
    assert len(figures.accepted) > 100, report
    assert figures.lost == [], report
    assert figures.wrong == [], report
    assert figures.recomputed == [], report
    assert figures.final_restart_to_final_s == figures.final_restart_to_final_s, report  # not NaN

"""Queued work across the fleet, with real `thaw serve` instances on PostgreSQL:

- a job that its instance cannot start soon (its model is cold) is recorded
  queued, and an idle instance with the model READY takes it and runs it; when
  the accepting instance gets to it itself (its load is done), its claim by id
  loses, and it does not run the job: the job runs once, and a long poll and a
  stream follower on the accepting instance get the result (and the items) from
  the store.

The cold instance's load is held by a file (the bundle's builder waits while it
exists), so the order is the test's, not the clock's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from runtime.dispatch.answers import JOB_NOW, Accepted
from runtime.jobs.job import JobStatus
from tests.fleet.conftest import MakeFleet
from tests.sse import SSE, collect
from tests.support import SAFETY_S, make_bundle, running_instance, settings_for, until

LEASE_S = "600"


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_cold_instances_job_is_taken_by_a_warm_one_and_runs_once(
    make_fleet: MakeFleet, tmp_path: Path
) -> None:
    ticks, hold = tmp_path / "ticks.log", tmp_path / "hold-load"
    bundles = tmp_path / "bundles"
    make_bundle(bundles, "tick-model", config={"hold": str(hold)})
    fleet = make_fleet(
        2,
        THAW_JOB_LEASE_S=LEASE_S,
        THAW_TEST_TICK_LOG=str(ticks),
        THAW_BUNDLE_SOURCE=str(bundles),
    )
    cold, warm = fleet.instances
    with cold.client() as here, warm.client() as there:
        there.post("/models/tick-model/load").raise_for_status()

        def warm_ready() -> bool:
            models = there.get("/models").raise_for_status().json()["models"]
            return any(m["name"] == "tick-model" and m["state"] == "ready" for m in models)

        until(warm_ready, "the warm instance to load the model")
        hold.touch()  # the cold instance's load waits from now on
        accepted = here.post("/handlers/model_ticks/jobs", json={"n": 3}).raise_for_status()
        job_id = accepted.json()["id"]
        assert accepted.json()["status"] == "queued"

        done = there.get(f"/jobs/{job_id}", params={"wait": 30}).raise_for_status().json()
        assert done["status"] == "succeeded", done
        assert done["output"] == {"text": "t0 t1 t2 ", "ticks": 3}
        assert done["attempts"] == 1
        assert f"running queued job {job_id}" in warm.log()

        hold.unlink()  # the cold instance's load ends: it gets to the job, and loses the claim
        until(
            lambda: f"job {job_id} was taken by another instance" in cold.log(),
            "the cold instance to lose its claim",
        )
        assert lines(ticks).count("end 3 done") == 1, lines(ticks)  # it ran once
        polled = here.get(f"/jobs/{job_id}", params={"wait": 30}).raise_for_status().json()
        assert (polled["status"], polled["output"]) == ("succeeded", done["output"])
        # A follower on the accepting instance reads the items the warm one wrote.
        with here.stream("GET", f"/jobs/{job_id}", headers=SSE) as response:
            events = collect(response)
        assert [e.get("id") for e in events] == ["0", "1", "2", None]
        assert orjson.loads(events[-1]["data"]) == done["output"]


@pytest.mark.anyio
async def test_a_queued_job_nobody_else_takes_is_claimed_and_run_by_its_own_instance(
    fleet_dsn: str, tmp_path: Path
) -> None:
    """One instance in-process: its cold job is recorded queued, and once its model
    is loaded it wins its own claim (on the handler thread) and runs the job once."""
    make_bundle(tmp_path / "bundles", "tick-model", config={"sleep_s": 0.2})
    settings = settings_for(
        tmp_path,
        job_store=fleet_dsn,
        handlers=("tests.handlers.ticks",),
    )
    async with running_instance(settings) as instance:
        async with asyncio.timeout(
            SAFETY_S
        ):  # the store opens, and the fleet starts, in the background
            while not instance.jobs.shared_queue:
                await asyncio.sleep(0.01)
        outcome = await instance.dispatcher.invoke(
            "model_ticks", {"n": 2}, policy=JOB_NOW, request_id="r1"
        )
        assert isinstance(outcome, Accepted) and outcome.job.status is JobStatus.QUEUED
        done = await instance.jobs.get(outcome.job.id, key_id=None, wait_s=SAFETY_S)
        assert done.status is JobStatus.SUCCEEDED, done
        assert done.output == {"text": "t0 t1 ", "ticks": 2}
        assert (done.owner, done.attempts) == (instance.jobs.owner, 1)

"""A fleet job recorded queued shows its live phase once its own instance claims it.

The claim writes `claimed`; the work is past that by then (running, tokens
out). With a lease of 600 s the first heartbeat would come 200 s in, past the
test's safety limit: what the store shows was written when the phase changed.
The load and the stream are held by files, so the order is the test's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.dispatch.answers import JOB_NOW, Accepted
from runtime.jobs.job import Job, JobStatus
from tests.inproc import until
from tests.support import SAFETY_S, make_bundle, running_instance, settings_for

pytestmark = pytest.mark.anyio


async def test_a_claimed_queued_job_shows_running_while_it_streams(
    fleet_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks = tmp_path / "ticks.log"
    monkeypatch.setenv("THAW_TEST_TICK_LOG", str(ticks))
    load_hold, run_hold = tmp_path / "load.hold", tmp_path / "run.hold"
    load_hold.touch()
    run_hold.touch()
    make_bundle(tmp_path / "bundles", "tick-model", config={"hold": str(load_hold)})
    settings = settings_for(
        tmp_path,
        job_store=fleet_dsn,
        handlers=("tests.handlers.ticks",),
        job_lease_s=600.0,
    )
    try:
        async with running_instance(settings) as instance:
            await until(lambda: instance.jobs.shared_queue, "the fleet started", in_thread=True)
            event = {"n": 3, "hold": str(run_hold), "hold_at": 1}
            outcome = await instance.dispatcher.invoke(
                "model_ticks", event, policy=JOB_NOW, request_id="queued"
            )
            assert isinstance(outcome, Accepted) and outcome.job.status is JobStatus.QUEUED

            def stored() -> Job:
                job = instance.store.get(outcome.job.id)
                assert job is not None
                return job

            load_hold.unlink()  # the load ends: the instance claims its own job and runs it
            await until(
                lambda: ticks.exists() and "tick 0" in ticks.read_text(), "tick 0", in_thread=True
            )
            await until(lambda: stored().status is JobStatus.RUNNING, "the claim", in_thread=True)
            await until(
                lambda: stored().phase == "running", "running, not `claimed`", in_thread=True
            )
            run_hold.unlink()
            done = await instance.jobs.get(outcome.job.id, key_id=None, wait_s=SAFETY_S)
            assert done.status is JobStatus.SUCCEEDED and done.attempts == 1
    finally:
        load_hold.unlink(missing_ok=True)
        run_hold.unlink(missing_ok=True)

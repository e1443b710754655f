"""A job's `phase` is current as soon as it changes, not at the next heartbeat.

The instance runs on a `ManualClock` that the test never advances: no
heartbeat ever fires, so every phase the store shows was written when the
work changed phase. A streaming job held in its load reads `loading`; held
midway through its stream (tokens out), `running`, never the `queued` it may
have been recorded with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.clock import ManualClock
from runtime.dispatch.answers import JOB_NOW, Accepted
from runtime.instance import Instance
from runtime.jobs.job import Job, JobStatus
from runtime.registry import discover
from tests.inproc import until
from tests.support import make_bundle, settings_for

pytestmark = pytest.mark.anyio


async def test_the_stored_phase_follows_the_work_without_a_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks = tmp_path / "ticks.log"
    monkeypatch.setenv("THAW_TEST_TICK_LOG", str(ticks))  # the handler's own record
    load_hold, run_hold = tmp_path / "load.hold", tmp_path / "run.hold"
    load_hold.touch()
    run_hold.touch()
    make_bundle(tmp_path / "bundles", "tick-model", config={"hold": str(load_hold)})
    settings = settings_for(
        tmp_path,
        handlers=("tests.handlers.ticks",),
    )
    clock = ManualClock()
    instance = Instance.create(settings, discover(settings.handlers), clock=clock)
    await instance.start()
    try:
        event = {"n": 3, "hold": str(run_hold), "hold_at": 1}
        answer = await instance.invoke("model_ticks", event, policy=JOB_NOW, request_id="phases")
        assert isinstance(answer, Accepted)
        job_id = answer.job.id

        def stored() -> Job:
            job = instance.store.get(job_id)
            assert job is not None
            return job

        def phase_is(phase: str) -> Callable[[], bool]:
            return lambda: stored().phase == phase

        await until(phase_is("loading"), "the job shows its load", in_thread=True)
        assert stored().status is JobStatus.RUNNING
        load_hold.unlink()  # the load ends; the stream runs, its first tick out
        await until(
            lambda: ticks.exists() and "tick 0" in ticks.read_text(),
            "tick 0 is out",
            in_thread=True,
        )
        await until(phase_is("running"), "the job shows it runs while it streams", in_thread=True)
        run_hold.unlink()
        done = await until(
            lambda: stored().status is JobStatus.SUCCEEDED and stored(),
            "the job ends",
            in_thread=True,
        )
        assert done.output == {"text": "t0 t1 t2 ", "ticks": 3}
        assert clock.monotonic() == 1000.0, "the clock never moved: no heartbeat fired"
    finally:
        load_hold.unlink(missing_ok=True)
        run_hold.unlink(missing_ok=True)
        await instance.stop()

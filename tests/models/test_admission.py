"""Memory admission through the whole runtime (issue 15, item 1), and the queue
limit under concurrency (item 4).

A budget that admits a given number of requests at a time on a READY bundle
(its weights plus that many per-request slots, plus a few bytes): requests
beyond it wait for a slot, are granted in arrival order, and are never left
waiting once slots free; a request whose deadline passes while it waits
becomes a job that finishes. Then the queue is empty again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.dispatch.answers import JOB_NOW, Accepted, Completed
from runtime.errors import QueueFull
from runtime.instance import Instance
from runtime.jobs.job import JobStatus
from runtime.registry import discover
from runtime.settings import Settings
from tests.support import ServerProcess, make_bundle, settings_for

pytestmark = pytest.mark.anyio

WEIGHTS = 1_000_000
PER_REQUEST = 1_000_000


def budget_for(slots: int) -> int:
    return WEIGHTS + slots * PER_REQUEST + 100


def slot_settings(tmp_path: Path, **overrides: Any) -> Settings:
    make_bundle(tmp_path / "bundles", "slot", weights_bytes=WEIGHTS, per_request_bytes=PER_REQUEST)
    values: dict[str, Any] = {
        "handlers": ("tests.handlers.ordered", "tests.handlers.gated", "tests.handlers.loadlog"),
        "job_lease_s": 3.0,
        **overrides,
    }
    return settings_for(tmp_path, **values)


async def started(settings: Settings) -> Instance:
    instance = Instance.create(settings, discover(settings.handlers))
    await instance.start()
    return instance


@pytest.mark.parametrize(("slots", "callers"), [(1, 20), (3, 31)])
async def test_waiters_for_a_memory_slot_are_all_served_in_arrival_order(
    tmp_path: Path, slots: int, callers: int
) -> None:
    instance = await started(slot_settings(tmp_path, memory_budget=budget_for(slots)))
    try:
        await instance.dispatcher.invoke("slot", {}, wait_s=60.0, request_id="load")
        outcomes = await asyncio.gather(
            *(
                instance.dispatcher.invoke(
                    "slot", {"sleep_s": 0.05}, wait_s=0.5, request_id=f"r{i:03d}"
                )
                for i in range(callers)
            )
        )
        jobs = [o.job.id for o in outcomes if isinstance(o, Accepted)]
        assert all(isinstance(o, Completed | Accepted) for o in outcomes)
        for job_id in jobs:  # every request that became a job finishes
            job = await instance.jobs.get(job_id, key_id=None, wait_s=30.0)
            assert job.status is JobStatus.SUCCEEDED, job.public()
        model = instance.cache.entries["slot"].model
        ran = [r for r in model.order if r != "load"]
        assert sorted(ran) == [f"r{i:03d}" for i in range(callers)]
        # Granted in arrival order: with one slot, exactly; with `slots` slots,
        # requests granted together start on their threads together, in any order
        # among themselves, so each starts within `slots` places of its arrival.
        late = {r: abs(place - int(r[1:])) for place, r in enumerate(ran)}
        assert max(late.values()) < slots, f"slots were not granted in arrival order: {ran}"
        assert instance.dispatcher.pending["slot"] == 0
        assert instance.cache.in_flight("slot") == 0 and instance.cache.budget.waiting() == 0
        assert instance.cache.reserved_bytes() <= budget_for(slots)
    finally:
        await instance.stop()


async def test_the_queue_limit_holds_under_any_concurrency(tmp_path: Path) -> None:
    """The check and the count are one step: 500 at once against a limit of 64."""
    from tests.handlers import gated

    gated.GATE.clear()
    instance = await started(slot_settings(tmp_path, max_queue=64))
    try:
        results = await asyncio.gather(
            *(
                instance.dispatcher.invoke("gated", {}, policy=JOB_NOW, request_id=f"j{i}")
                for i in range(500)
            ),
            return_exceptions=True,
        )
        accepted = [r for r in results if isinstance(r, Accepted)]
        refused = [r for r in results if isinstance(r, QueueFull)]
        assert len(accepted) == 64 and len(refused) == 436, [
            r for r in results if not isinstance(r, Accepted | QueueFull)
        ]
        assert all(r.retry_after_s is not None for r in refused)
        assert instance.dispatcher.pending["gated"] == 64
    finally:
        gated.GATE.set()
        await instance.stop()


def test_64_concurrent_callers_through_a_server_all_answered_and_the_queue_drains(
    tmp_path: Path, thaw_env: dict[str, str]
) -> None:
    """Issue 15's reproduction at 64 callers, over real HTTP: one slot at a time."""
    make_bundle(tmp_path / "bundles", "slot", weights_bytes=WEIGHTS, per_request_bytes=PER_REQUEST)
    env = {
        **thaw_env,
        "THAW_BUNDLE_SOURCE": str(tmp_path / "bundles"),
        "THAW_HANDLERS": "tests.handlers.ordered",
        "THAW_MEMORY_BUDGET": str(budget_for(1)),
        "THAW_PREWARM": "slot",
    }
    with ServerProcess(env) as server, server.client() as client:
        while client.get("/readyz").status_code != 200:  # prewarm done
            threading.Event().wait(0.05)
        barrier = threading.Barrier(64)

        def call(i: int) -> httpx.Response:
            with server.client() as own:
                barrier.wait()
                return own.post(
                    "/invoke/slot",
                    json={"sleep_s": 0.02},
                    headers={"Prefer": "wait=1", "X-Request-Id": f"r{i:03d}"},
                )

        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            responses = list(pool.map(call, range(64)))
        assert sorted({r.status_code for r in responses}) in ([200], [200, 202], [202])
        for response in responses:
            if response.status_code == 202:
                job = client.get(f"{response.headers['Location']}?wait=30").json()
                assert job["status"] == "succeeded", job
        models = client.get("/models").json()
        slot = next(m for m in models["models"] if m["name"] == "slot")
        assert slot["in_flight"] == 0 and slot["waiting_for_memory"] == 0
        metrics = client.get("/metrics").text
        assert 'thaw_queue_depth{handler="slot"} 0.0' in metrics

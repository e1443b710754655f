"""A drain waits for every request it admitted, including one still on its way to its start.

A request takes its queue slot at admission, then may await before its work
starts (a cold handler's load estimate reads the bundle's manifest; a job is
recorded first): in that window it is counted as pending but not yet in
flight. A drain that waited only for the work in flight let such a request
start after the drain had ended, under a process about to exit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.inproc import serving, settings_for, until
from tests.support import make_bundle

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("prefer", ["wait=30", "respond-async"])
async def test_a_drain_waits_for_a_request_admitted_before_its_work_started(
    tmp_path: Path, prefer: str
) -> None:
    make_bundle(tmp_path / "bundles", "alpha")
    settings = settings_for(tmp_path, handlers=("tests.handlers.loadlog",), drain_grace_s=60.0)
    async with serving(settings) as served:
        dispatcher = served.instance.dispatcher
        workload = dispatcher.workload
        call = asyncio.ensure_future(
            served.client.post("/invoke/alpha", json={}, headers={"Prefer": prefer})
        )
        await until(lambda: workload.admitting, "the request admitted", every_s=0)
        # In the window: its slot is taken, its work not started.
        assert dispatcher.pending["alpha"] == 1 and not workload.in_flight
        await dispatcher.drain(settings.drain_grace_s)
        # The drain ended only once that request's work had ended.
        assert dispatcher.pending["alpha"] == 0 and not workload.in_flight
        assert workload.admitting == 0
        response = await call
        assert response.status_code in (200, 202), response.text
        if response.status_code == 202:
            job = (await served.client.get(response.headers["location"])).json()
            assert job["status"] == "succeeded", job


async def test_new_requests_after_the_drain_began_are_refused(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundles", "alpha")
    settings = settings_for(tmp_path, handlers=("tests.handlers.loadlog",))
    async with serving(settings) as served:
        await served.instance.dispatcher.drain(0.0)
        response = await served.client.post("/invoke/alpha", json={})
        assert response.status_code == 503, response.text
        assert response.json()["type"].endswith("/drained")

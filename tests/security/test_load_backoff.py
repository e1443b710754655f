"""A tenant cannot push a bundle into a growing back-off for everyone: the back-off
after failed loads has a cap, and a load ended by a deliberate unload (an
operator's) is no failure and leaves no back-off behind."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from runtime.clock import ManualClock
from runtime.dispatch.answers import Completed
from runtime.errors import LoadFailed
from runtime.instance import Instance
from runtime.models.lifecycle import State
from runtime.models.loading import MAX_BACKOFF_DOUBLINGS
from runtime.registry import discover
from runtime.settings import Settings
from tests.handlers import held
from tests.support import make_bundle, settings_for

pytestmark = pytest.mark.anyio
BACKOFF_S = 10.0


def backoff_settings(tmp_path: Path, handlers: tuple[str, ...]) -> Settings:
    return settings_for(
        tmp_path,
        handlers=handlers,
        retry_backoff_s=BACKOFF_S,
    )


async def call(instance: Instance, handler: str) -> Any:
    outcome = await instance.dispatcher.invoke(handler, {}, wait_s=60.0, request_id="t")
    assert isinstance(outcome, Completed)
    return outcome.output


async def test_the_backoff_after_failed_loads_stops_growing(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    fault.touch()
    make_bundle(tmp_path / "bundles", "alpha", config={"fault_file": str(fault)})
    settings = backoff_settings(tmp_path, ("tests.handlers.loadlog",))
    clock = ManualClock()
    instance = Instance.create(settings, discover(settings.handlers), clock=clock)
    await instance.start()
    cap_s = BACKOFF_S * 2**MAX_BACKOFF_DOUBLINGS
    waits = []
    try:
        for _ in range(MAX_BACKOFF_DOUBLINGS + 6):
            with pytest.raises(Exception, match="injected builder fault"):
                await call(instance, "alpha")  # a new attempt, which fails again
            with pytest.raises(LoadFailed) as info:
                await call(instance, "alpha")  # within its back-off: not tried
            assert info.value.retry_after_s is not None
            waits.append(info.value.retry_after_s)
            clock.advance(info.value.retry_after_s + 0.01)
        entry = instance.cache.entries["alpha"]
        assert entry.failures == MAX_BACKOFF_DOUBLINGS + 6
        # Doubled per failure, then held at the cap however many failures follow.
        assert waits[1] > waits[0] * 1.9
        assert all(w <= cap_s for w in waits)
        assert waits[-1] > cap_s * 0.99 and waits[-2] > cap_s * 0.99
        fault.unlink()
        clock.advance(cap_s)
        assert (await call(instance, "alpha"))["bundle"] == "alpha"
        assert entry.failures == 0
    finally:
        await instance.stop()


async def test_an_unload_during_a_load_leaves_no_backoff(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundles", "held")
    settings = backoff_settings(tmp_path, ("tests.handlers.held",))
    held.BUILD_GATE.clear()
    instance = Instance.create(settings, discover(settings.handlers))
    await instance.start()
    try:
        entry = None
        for _ in range(3):  # load-then-unload, again and again
            held.BUILDING.clear()
            waiting = asyncio.create_task(call(instance, "held"))
            while not held.BUILDING.is_set():
                await asyncio.sleep(0.01)
            await instance.unload_bundle("held")
            with pytest.raises(LoadFailed, match="unloaded while loading"):
                await waiting
            entry = instance.cache.entries["held"]
            assert entry.lifecycle.state is State.FAILED
            assert entry.failures == 0 and entry.retry_at == 0.0
        # No back-off: the next caller's load begins at once and serves.
        held.BUILD_GATE.set()
        assert await call(instance, "held") == {"tensors": 1}
        assert entry is not None and entry.lifecycle.state is State.READY
    finally:
        held.BUILD_GATE.set()
        await instance.stop()

"""The model cache in-process: single flight, parallel loads, integrity, faults, budget."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

from runtime.bundles.manifest import MANIFEST, Manifest
from runtime.clock import SYSTEM, Clock, ManualClock
from runtime.dispatch.answers import Completed
from runtime.errors import BundleError, InsufficientMemory, IntegrityError, LoadFailed
from runtime.instance import Instance
from runtime.models.lifecycle import State
from runtime.registry import discover
from runtime.settings import Settings
from tests.handlers import loadlog
from tests.support import make_bundle, settings_for

pytestmark = pytest.mark.anyio


def loadlog_settings(tmp_path: Path, **overrides: Any) -> Settings:
    return settings_for(
        tmp_path,
        handlers=("tests.handlers.loadlog",),
        **{"retry_backoff_s": 0.2, **overrides},
    )


async def call(instance: Instance, handler: str, event: Any = None) -> Any:
    outcome = await instance.dispatcher.invoke(handler, event or {}, wait_s=60.0, request_id="test")
    assert isinstance(outcome, Completed)
    return outcome.output


async def started(settings: Settings, clock: Clock = SYSTEM) -> Instance:
    instance = Instance.create(settings, discover(settings.handlers), clock=clock)
    await instance.start()
    return instance


async def test_32_concurrent_first_invocations_load_once(tmp_path: Path) -> None:
    log = tmp_path / "loads.log"
    make_bundle(tmp_path / "bundles", "alpha", config={"sleep_s": 0.3, "log_file": str(log)})
    instance = await started(loadlog_settings(tmp_path))
    try:
        outputs = await asyncio.gather(*(call(instance, "alpha") for _ in range(32)))
    finally:
        await instance.stop()
    assert len(log.read_text().splitlines()) == 1
    assert len({o["model_id"] for o in outputs}) == 1
    assert instance.cache.entries["alpha"].loads == 1


class CountingSource:
    """An instance's own bundle source, counting its manifest reads; each read is
    held until the test opens `gate`, so every concurrent caller overlaps it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reads = 0
        self._lock = threading.Lock()
        self.gate = threading.Event()

    def manifest(self, name: str) -> Manifest:
        with self._lock:
            self.reads += 1
        self.gate.wait(30)
        manifest: Manifest = self.inner.manifest(name)
        return manifest


async def while_the_read_is_held(source: CountingSource, calls: list[Any]) -> list[Any]:
    """Run `calls` at once while the first manifest read is held, then let it end."""
    running = asyncio.gather(*calls, return_exceptions=True)
    while source.reads == 0:  # the read runs in a worker thread
        await asyncio.sleep(0.005)
    # Every caller started in the loop turn the read began in: all wait on it now.
    source.gate.set()
    return await running

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


async def test_a_burst_of_cold_estimates_reads_the_manifest_once(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundles", "alpha")
    instance = await started(loadlog_settings(tmp_path))
    source = instance.cache.source = CountingSource(instance.cache.source)
    try:
        calls = [instance.cache.estimate_ready_s("alpha") for _ in range(64)]
        estimates = await while_the_read_is_held(source, calls)
        assert source.reads == 1
        assert all(isinstance(e, float) and e > 0 for e in estimates), estimates
        await instance.cache.estimate_ready_s("alpha")
        assert source.reads == 1, "a known manifest was read again"
    finally:
        await instance.stop()


async def test_a_failed_manifest_read_fails_every_waiter_and_is_retried(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundles", "alpha")
    manifest_file = tmp_path / "bundles" / "alpha" / MANIFEST
    good = manifest_file.read_bytes()
    manifest_file.write_bytes(b"{not json")
    instance = await started(loadlog_settings(tmp_path))
    source = instance.cache.source = CountingSource(instance.cache.source)
    try:
        calls = [instance.cache.manifest_of("alpha") for _ in range(8)]
        results = await while_the_read_is_held(source, calls)
        assert source.reads == 1
        assert all(isinstance(r, BundleError) for r in results), results
        manifest_file.write_bytes(good)
        assert (await instance.cache.manifest_of("alpha")).name == "alpha"
        assert source.reads == 2
    finally:
        await instance.stop()


async def test_different_bundles_load_concurrently(tmp_path: Path) -> None:
    # Each builder waits for the other (loadlog.MEET): loads that ran one after the
    # other would never meet, and fail; how long each took does not matter.
    for name in ("alpha", "beta"):
        make_bundle(tmp_path / "bundles", name, config={"meet": True})
    loadlog.MEET.reset()
    instance = await started(loadlog_settings(tmp_path))
    try:
        a, b = await asyncio.gather(call(instance, "alpha"), call(instance, "beta"))
    finally:
        await instance.stop()
    (a_start, a_end), (b_start, b_end) = a["load"], b["load"]
    assert max(a_start, b_start) <= min(a_end, b_end), "each load ran inside the other's"


async def test_flipped_byte_fails_integrity_then_recovers(tmp_path: Path) -> None:
    manifest = make_bundle(tmp_path / "bundles", "alpha", shards=3)
    shard = tmp_path / "bundles" / "alpha" / manifest.files[1].path
    original = shard.read_bytes()
    corrupt = bytearray(original)
    corrupt[len(corrupt) // 2] ^= 0x01
    shard.write_bytes(bytes(corrupt))
    clock = ManualClock()
    # A back-off no test run outlasts: only the clock's skip gets past it.
    instance = await started(loadlog_settings(tmp_path, retry_backoff_s=600.0), clock)
    try:
        with pytest.raises(IntegrityError, match=manifest.files[1].path):
            await call(instance, "alpha")
        entry = instance.cache.entries["alpha"]
        assert entry.lifecycle.state is State.FAILED
        assert entry.model is None and instance.cache.budget.reservation("alpha") is None
        assert entry.lifecycle.error is not None
        assert entry.lifecycle.error["type"] == "integrity"
        assert instance.cache.reserved_bytes() == 0
        shard.write_bytes(original)
        with pytest.raises(LoadFailed, match="integrity"):
            await call(instance, "alpha")  # within the back-off: not tried again
        clock.advance(600.0)
        output = await call(instance, "alpha")
        assert output["tensors"] == 3
        assert entry.lifecycle.state is State.READY
    finally:
        await instance.stop()


async def test_builder_fault_fails_then_succeeds_after_backoff(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    fault.touch()
    make_bundle(tmp_path / "bundles", "alpha", config={"fault_file": str(fault)})
    clock = ManualClock()
    instance = await started(loadlog_settings(tmp_path, retry_backoff_s=600.0), clock)
    try:
        with pytest.raises(Exception, match="injected builder fault"):
            await call(instance, "alpha")
        entry = instance.cache.entries["alpha"]
        assert entry.lifecycle.state is State.FAILED
        assert entry.lifecycle.error is not None
        assert "injected builder fault" in entry.lifecycle.error["message"]
        fault.unlink()
        # Within the back-off the cause is reported, not retried.
        with pytest.raises(LoadFailed, match="injected builder fault") as info:
            await call(instance, "alpha")
        assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
        clock.advance(600.0)
        assert (await call(instance, "alpha"))["bundle"] == "alpha"
    finally:
        await instance.stop()


async def test_failed_load_leaves_no_model_alive(tmp_path: Path) -> None:
    """A builder fault after weights were read releases every tensor."""
    fault = tmp_path / "fault"
    fault.touch()
    make_bundle(tmp_path / "bundles", "alpha", config={"fault_file": str(fault)})
    instance = await started(loadlog_settings(tmp_path))
    import torch

    try:
        with pytest.raises(Exception, match="injected"):
            await call(instance, "alpha")
        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            live = [
                o
                for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and o.numel() == 256 and o.dtype == torch.float32
            ]
        assert live == [], "tensors of the failed load are still referenced"
    finally:
        await instance.stop()


async def test_budget_evicts_lru_idle_never_in_use_and_refuses_too_large(tmp_path: Path) -> None:
    unit = 1_000_000
    for name in ("alpha", "beta", "gamma"):
        make_bundle(tmp_path / "bundles", name, weights_bytes=unit)
    make_bundle(tmp_path / "bundles", "huge", weights_bytes=5 * unit)
    instance = await started(loadlog_settings(tmp_path, memory_budget=int(2.5 * unit)))
    cache = instance.cache
    try:
        # alpha is busy (held) until beta and gamma are done; beta idle; gamma needs room.
        loadlog.HOLD.clear()
        busy = asyncio.ensure_future(call(instance, "alpha", {"hold": True}))
        while cache.in_flight("alpha") == 0:  # loaded, and its handler running
            await asyncio.sleep(0.01)
        await call(instance, "beta")
        assert cache.in_flight("alpha") == 1
        await call(instance, "gamma")
        assert cache.entries["beta"].lifecycle.state is State.UNLOADED
        assert cache.entries["alpha"].lifecycle.state is State.READY
        assert cache.entries["gamma"].lifecycle.state is State.READY
        loadlog.HOLD.set()
        await busy
        # Now alpha is idle and least recently used: beta's return evicts alpha, not gamma.
        await call(instance, "gamma")
        await call(instance, "beta")
        assert cache.entries["alpha"].lifecycle.state is State.UNLOADED
        assert cache.entries["gamma"].lifecycle.state is State.READY
        with pytest.raises(InsufficientMemory, match="whole memory budget"):
            await call(instance, "huge")
        assert cache.entries["gamma"].lifecycle.state is State.READY, "refusal evicted nothing"
    finally:
        loadlog.HOLD.set()
        await instance.stop()


async def test_a_phase_with_no_progress_fails_when_the_clock_passes_its_stall_limit(
    tmp_path: Path,
) -> None:
    """The no-progress deadline is armed on the instance's clock: the builder hangs
    (tests/handlers/stuck.py) and the load fails only once the clock passes it."""
    release = tmp_path / "release"
    make_bundle(tmp_path / "bundles", "stuck", config={"release": str(release)})
    clock = ManualClock()
    settings = dataclasses.replace(
        loadlog_settings(tmp_path, phase_stall_s=300.0, drain_grace_s=0.5),
        handlers=("tests.handlers.stuck",),
    )
    instance = await started(settings, clock)
    try:
        loading = asyncio.ensure_future(instance.cache.acquire("stuck"))
        entry = instance.cache.entry("stuck")
        # LOADED is set in the step that arms the init phase's stall timer.
        while entry.lifecycle.state is not State.LOADED:  # the builder has started
            await asyncio.sleep(0.005)
        clock.advance(299.0)
        for _ in range(20):  # the loop turns a failure due now would take to surface
            await asyncio.sleep(0)
        assert not loading.done() and entry.lifecycle.state is State.LOADED
        clock.advance(2.0)
        with pytest.raises(LoadFailed, match="init made no progress for 300 s"):
            await asyncio.wait_for(loading, 30)
        assert entry.lifecycle.state is State.FAILED
        assert instance.health.wedged is not None and "init" in instance.health.wedged.detail
    finally:
        release.touch()
        await instance.stop()

"""Warm-up: every declared path is warm before any request is served, the
accelerator's examples run on an accelerator only, and nothing of the
framework is loaded before a model is asked for."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from runtime.dispatch.answers import Completed
from runtime.errors import LoadFailed
from runtime.instance import Instance
from runtime.registry import discover
from runtime.settings import Settings
from tests.support import make_bundle, settings_for

pytestmark = pytest.mark.anyio


def warmed_settings(tmp_path: Path, **overrides: Any) -> Settings:
    make_bundle(tmp_path / "bundles", "paths")
    return settings_for(tmp_path, **{"handlers": ("tests.handlers.warmed",), **overrides})


async def test_every_declared_path_is_warm_before_the_first_request_is_served(
    tmp_path: Path,
) -> None:
    settings = warmed_settings(tmp_path)
    instance = Instance.create(settings, discover(settings.handlers))
    await instance.start()
    try:
        # Requests arrive together with the load they trigger; none may run first.
        outcomes = await asyncio.gather(
            *(
                instance.dispatcher.invoke(
                    "paths", {"path": "real"}, wait_s=60.0, request_id=f"r{i}"
                )
                for i in range(4)
            )
        )
        assert all(isinstance(o, Completed) for o in outcomes)
        calls = instance.cache.entries["paths"].model.calls
        warmups = [path for request_id, path, _ in calls if request_id.startswith("warmup-")]
        assert warmups == ["small", "sampled"]  # on the CPU: no accelerator example
        first_real = next(i for i, (rid, _, _) in enumerate(calls) if not rid.startswith("warmup"))
        assert first_real == len(warmups), calls
    finally:
        await instance.stop()


async def test_a_warm_up_that_raises_fails_the_load_naming_warmup_and_others_serve(
    tmp_path: Path,
) -> None:
    make_bundle(tmp_path / "bundles", "fussy")
    settings = warmed_settings(tmp_path)
    instance = Instance.create(settings, discover(settings.handlers))
    await instance.start()
    try:
        with pytest.raises(LoadFailed) as failed:
            await instance.dispatcher.invoke(
                "fussy", {"path": "real"}, wait_s=60.0, request_id="r1"
            )
        assert (failed.value.status, failed.value.slug) == (503, "load-failed")
        assert failed.value.extra == {"phase": "warmup"}
        assert "warm-up 1 of handler 'fussy' failed" in failed.value.message
        assert instance.cache.entries["fussy"].model is None  # nothing half-built kept
        # The instance keeps serving its other models.
        served = await instance.dispatcher.invoke(
            "paths", {"path": "real"}, wait_s=60.0, request_id="r2"
        )
        assert served.output == {"calls": 3}
    finally:
        await instance.stop()


def test_accelerator_examples_follow_the_cpu_ones_on_an_accelerator_only() -> None:
    spec = discover(["tests.handlers.warmed"]).handler("paths")
    assert [e["path"] for e in spec.warmup_for("cpu")] == ["small", "sampled"]
    assert [e["path"] for e in spec.warmup_for("cuda")] == ["small", "sampled", "large"]
    assert [e["path"] for e in spec.warmup_for("cuda:1")] == ["small", "sampled", "large"]


@pytest.mark.gpu
async def test_a_load_onto_cuda_runs_the_accelerator_warmup_too(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (runs on a device machine)")
    settings = warmed_settings(tmp_path, device="cuda")
    instance = Instance.create(settings, discover(settings.handlers))
    await instance.start()
    try:
        outcome = await instance.dispatcher.invoke(
            "paths", {"path": "real"}, wait_s=120.0, request_id="r"
        )
        assert isinstance(outcome, Completed)
        calls = instance.cache.entries["paths"].model.calls
        assert [p for rid, p, _ in calls if rid.startswith("warmup-")] == [
            "small",
            "sampled",
            "large",
        ]
    finally:
        await instance.stop()


async def test_a_batched_handler_is_warmed_through_its_batched_function(tmp_path: Path) -> None:
    from tests.handlers import batched

    settings = warmed_settings(tmp_path, handlers=("tests.handlers.batched",))
    make_bundle(tmp_path / "bundles", "ledger")
    batched.BATCHES.clear()
    instance = Instance.create(settings, discover(settings.handlers))
    await instance.start()
    try:
        outcome = await instance.dispatcher.invoke(
            "batch_ledger", {"id": 1}, wait_s=60.0, request_id="r1"
        )
        assert isinstance(outcome, Completed) and outcome.batch_size == 1
    finally:
        await instance.stop()
    # The warm-up example ran as a batch of one, before the first request's batch.
    assert batched.BATCHES == [["warm-up"], [1]]

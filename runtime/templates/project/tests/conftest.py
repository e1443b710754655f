"""`invoke`: one invocation of a handler in-process, as `thaw invoke` runs it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.instance import Instance
from runtime.settings import Settings

PROJECT = Path(__file__).resolve().parents[1]


@pytest.fixture
def invoke(tmp_path: Path) -> Callable[..., Any]:
    """`invoke(handler, event, bundles=DIR)`: the handler's output; the job store, the
    node cache and the load statistics live in tmp_path."""

    def call(handler: str, event: Any, *, bundles: Path | None = None) -> Any:
        settings = Settings.from_env(
            project_dir=str(PROJECT),
            bundle_source=str(bundles or PROJECT / "bundles"),
            job_store=f"sqlite:///{tmp_path}/jobs.sqlite3",
            cache_dir=str(tmp_path / "cache"),
            state_dir=str(tmp_path / "state"),
            prewarm=(),
        )
        return asyncio.run(_invoke(settings, handler, event))

    return call


async def _invoke(settings: Settings, handler: str, event: Any) -> Any:
    instance = Instance.create(settings)
    await instance.start()
    try:
        answer = await instance.invoke(handler, event, wait_s=float("inf"), request_id="test")
        return answer.output
    finally:
        await instance.stop()

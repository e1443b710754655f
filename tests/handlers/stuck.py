"""User code that stops making progress until the test lets it go.

Every wait is for a file to appear (`config["release"]` for builders and
warm-ups, `event["release"]` for handlers), so a test can release code in
another process too; nothing waits longer than `LIMIT_S`.

    bundle `stuck`       its builder waits
    bundle `stuckraises` its builder waits, then raises
    bundle `warmstuck`   builds at once; the warm-up of `warmhang` waits
    handler `hang`       sync, no model: waits in its thread (touching
                         `event["started"]` first, when given)
    handler `ahang`      async, no model: waits on the loop (cancellable)
    handler `ahang_batch`
                         async, batched (one batch at a time): waits on the loop
                         for `{"release": P}`, answers `{"quick": true}` at once;
                         `CANCELLED` gets the size of each batch cancelled
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from runtime import Batch, Context, bundle, handler

LIMIT_S = 120.0


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class Released:
    def __init__(self, release: str) -> None:
        self.release = release


@bundle("stuck")
def build_stuck(config: dict[str, Any]) -> Released:
    _wait_for(config["release"])
    return Released(config["release"])


@bundle("stuckraises")
def build_stuckraises(config: dict[str, Any]) -> Released:
    _wait_for(config["release"])
    raise RuntimeError("the builder gave up")


@bundle("warmstuck")
def build_warmstuck(config: dict[str, Any]) -> Released:
    return Released(config["release"])


@handler("stuckmodel", uses=["stuck"])
def stuckmodel(event: Any, model: Released, ctx: Context) -> dict[str, Any]:
    return {"ok": True}


@handler("stuckraisesmodel", uses=["stuckraises"])
def stuckraisesmodel(event: Any, model: Released, ctx: Context) -> dict[str, Any]:
    return {"ok": True}


@handler("warmhang", uses=["warmstuck"], warmup=[{"hang": True}])
def warmhang(event: Any, model: Released, ctx: Context) -> dict[str, Any]:
    if ctx.warmup and event.get("hang"):
        _wait_for(model.release)
    return {"ok": True}


@handler("hang")
def hang(event: Any, ctx: Context) -> dict[str, Any]:
    if "started" in event:  # tells a test it is running
        Path(event["started"]).touch()
    _wait_for(event["release"])
    return {"released": True}


@handler("ahang")
async def ahang(event: Any, ctx: Context) -> dict[str, Any]:
    while not Path(event["release"]).exists():
        await asyncio.sleep(0.01)
    return {"released": True}


CANCELLED: list[int] = []


@handler("ahang_batch", batch=Batch(max_size=4, max_wait_ms=0, max_concurrent=1))
async def ahang_batch(events: list[Any], ctxs: list[Context]) -> list[Any]:
    try:
        for event in events:
            while "release" in event and not Path(event["release"]).exists():
                await asyncio.sleep(0.01)
    except asyncio.CancelledError:
        CANCELLED.append(len(events))
        raise
    return [{"released": "release" in event} for event in events]

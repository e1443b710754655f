"""Bundle `held`, whose builder waits in its thread until the test opens `BUILD_GATE`
(`BUILDING` is set once it waits): a load that holds its memory reservation for as
long as the test wants. Handler `held` uses it, and so does `held_async`, an
`async def` (run on the loop, not a handler thread)."""

from __future__ import annotations

import threading
from typing import Any

from runtime import Context, bundle, handler

BUILD_GATE = threading.Event()
BUILDING = threading.Event()


@bundle("held")
def build_held(weights: dict[str, Any]) -> dict[str, Any]:
    BUILDING.set()
    if not BUILD_GATE.wait(timeout=30):
        raise TimeoutError("the test never opened the build gate")
    return {"tensors": len(weights)}


@handler("held", uses=["held"])
def held(event: Any, model: dict[str, Any], ctx: Context) -> dict[str, Any]:
    return model


@handler("held_async", uses=["held"])
async def held_async(event: Any, model: dict[str, Any], ctx: Context) -> dict[str, Any]:
    return {**model, "event": event}

"""Handlers that do not return within any test's patience.

`hangs`: a sync handler that blocks its thread for `event["s"]` seconds (a
day by default): a thread the runtime can neither stop nor wait for.
`hangs_async`: an async handler that awaits `event["s"]` seconds (a day by
default) on the loop, so a drain can cancel it.
`entered`: how many calls of either reached the handler; a test polls it
through `entered_count` to know its callers are in flight.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from runtime import Context, handler

DAY_S = 86_400.0
_ENTERED = 0
_LOCK = threading.Lock()


def _enter() -> None:
    global _ENTERED
    with _LOCK:
        _ENTERED += 1


def _seconds(event: Any) -> float:
    return float(event.get("s", DAY_S)) if isinstance(event, dict) else DAY_S


@handler("hangs")
def hangs(event: Any, ctx: Context) -> dict[str, Any]:
    _enter()
    time.sleep(_seconds(event))
    return {"slept_s": _seconds(event)}


@handler("hangs_async")
async def hangs_async(event: Any, ctx: Context) -> dict[str, Any]:
    _enter()
    await asyncio.sleep(_seconds(event))
    return {"slept_s": _seconds(event)}


@handler("entered_count")
def entered_count(event: Any, ctx: Context) -> dict[str, int]:
    with _LOCK:
        return {"entered": _ENTERED}

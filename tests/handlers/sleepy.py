"""`sleepy`: sleeps `event["s"]` seconds without blocking the event loop.

`blocks`: sleeps `event["s"]` seconds *on* the event loop (a user bug), so the
runtime cannot answer before the deadline and the platform's timeout fires.
Both return the process id, so a test can tell instances apart.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from runtime import Context, handler


@handler("sleepy")
async def sleepy(event: Any, ctx: Context) -> Any:
    await asyncio.sleep(float(event.get("s", 0.0)))
    return {"slept_s": event.get("s", 0.0), "pid": os.getpid()}


@handler("blocks")
async def blocks(event: Any, ctx: Context) -> Any:
    time.sleep(float(event.get("s", 0.0)))
    return {"slept_s": event.get("s", 0.0), "pid": os.getpid()}

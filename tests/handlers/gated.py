"""`gated`: a sync handler that waits in its thread until the test opens `GATE`;
`ENTERED` gets one item per call that reached the gate.

`pair`: a sync handler of two bundles, `alpha` and `beta` (built by
tests.handlers.loadlog).
"""

from __future__ import annotations

import threading
from typing import Any

from runtime import Context, handler

GATE = threading.Event()
ENTERED: list[str] = []


@handler("gated")
def gated(event: Any, ctx: Context) -> dict[str, Any]:
    ENTERED.append(ctx.request_id)
    if not GATE.wait(timeout=30):
        raise TimeoutError("the test never opened the gate")
    return {"thread": threading.current_thread().name}


@handler("pair", uses=["alpha", "beta"])
def pair(event: Any, alpha: Any, beta: Any, ctx: Context) -> dict[str, Any]:
    return {"bundles": [alpha.name, beta.name]}

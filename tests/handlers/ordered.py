"""Bundle `slot` and handler `slot`, which records the order requests start to run
in (`Slot.order`, request ids) and sleeps `event["sleep_s"]` in its thread.
Give the bundle a `per_request_bytes` and a budget to admit a few at a time."""

from __future__ import annotations

import threading
import time
from typing import Any

from runtime import Context, bundle, handler


class Slot:
    def __init__(self) -> None:
        self.order: list[str] = []
        self.lock = threading.Lock()


@bundle("slot")
def build_slot(weights: dict[str, Any]) -> Slot:
    return Slot()


@handler("slot", uses=["slot"])
def slot(event: Any, model: Slot, ctx: Context) -> dict[str, Any]:
    with model.lock:
        model.order.append(ctx.request_id)
    time.sleep(float(event.get("sleep_s", 0.0)))
    return {"request_id": ctx.request_id}

"""`held_call`: a sync handler each of whose calls waits in its thread until the
test releases it by its event's `id` (`release(id)`); `STARTED` lists the ids in
the order their calls began."""

from __future__ import annotations

import threading
from typing import Any

from runtime import Context, handler

STARTED: list[str] = []
_EVENTS: dict[str, threading.Event] = {}
_LOCK = threading.Lock()


def _event(run_id: str) -> threading.Event:
    with _LOCK:
        return _EVENTS.setdefault(run_id, threading.Event())


def release(run_id: str) -> None:
    _event(run_id).set()


def reset() -> None:
    with _LOCK:
        for event in _EVENTS.values():
            event.set()  # a call the test left held ends
        _EVENTS.clear()
    STARTED.clear()


@handler("held_call")
def held_call(event: Any, ctx: Context) -> dict[str, str]:
    run_id = str(event["id"])
    STARTED.append(run_id)
    if not _event(run_id).wait(timeout=60):
        raise TimeoutError(f"the test never released call {run_id}")
    return {"id": run_id}

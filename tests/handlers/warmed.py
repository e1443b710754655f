"""Bundle `paths` and handler `paths`, which records every call it gets, warm-up or
not, in `Paths.calls` (request id, event's `path`, thread name), in order. Two CPU warm-up
paths and one accelerator-only path."""

from __future__ import annotations

import threading
from typing import Any

from runtime import Context, bundle, handler


class Paths:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()


@bundle("paths")
def build_paths(weights: dict[str, Any]) -> Paths:
    return Paths()


@handler(
    "paths",
    uses=["paths"],
    warmup=[{"path": "small"}, {"path": "sampled"}],
    accelerator_warmup=[{"path": "large"}],
)
def paths(event: Any, model: Paths, ctx: Context) -> dict[str, Any]:
    with model.lock:
        model.calls.append(
            (ctx.request_id, str(event.get("path")), threading.current_thread().name)
        )
    return {"calls": len(model.calls)}


@bundle("fussy")
def build_fussy(weights: dict[str, Any]) -> Paths:
    return Paths()


@handler("fussy", uses=["fussy"], warmup=[{"path": "small"}, {"path": "refused"}])
def fussy(event: Any, model: Paths, ctx: Context) -> dict[str, Any]:
    """Fails its second warm-up example, as a handler that cannot take a warm-up
    shape does: its bundle never becomes READY."""
    if ctx.warmup and event.get("path") == "refused":
        raise ValueError("this shape is not supported")
    return {"path": event.get("path")}

"""Batched handlers (`batch=Batch(...)`), named by behaviour.

`batch_gated` (sync, max_size 8, max_wait 60 s: only a free run slot, the
company it expects or a deadline starts a batch) answers each event
`{"id": ...}` with `{"id", "batch": [the ids of its batch, in order], "size",
"request_id"}`; `BATCHES` gets the ids of every batch it ran. In place of an
event it returns:

    {"hold": true}        waits in its thread (holding the batch) until the test
                          opens `GATE`; {"hold_file": P}: until file P exists
                          (a test driving another process)
    {"refuse": F}         InvalidInput(F, ...)   -> only that caller gets a 400
    {"fail": M}           ValueError(M)          -> only that caller gets a 500

`batch_async`: the same outputs from an `async def` (no holding); an event
{"exit": true} makes it call sys.exit() for the whole batch.
`batch_raises`: raises for the whole batch. `batch_miscounts`: returns one
output fewer than it was given.
`batch_ledger`: `batch_gated` over bundle `ledger` (any weights), for memory
admission under batching; its warm-up example is {"id": "warm-up"}.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from runtime import Batch, Context, InvalidInput, bundle, handler

GATE = threading.Event()
BATCHES: list[list[Any]] = []
POLICY = Batch(max_size=8, max_wait_ms=60_000)


def _hold(event: Any) -> None:
    if event.get("hold") and not GATE.wait(timeout=30):
        raise TimeoutError("the test never opened the gate")
    path = event.get("hold_file")
    if path:
        deadline = time.monotonic() + 30
        while not Path(path).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} never appeared")
            time.sleep(0.01)


def _outputs(events: list[Any], ctxs: list[Context]) -> list[Any]:
    ids = [e.get("id") if isinstance(e, dict) else None for e in events]
    BATCHES.append(ids)
    outputs: list[Any] = []
    for event, ctx in zip(events, ctxs, strict=True):
        if not isinstance(event, dict):
            outputs.append(InvalidInput("event", "must be an object"))
        elif "refuse" in event:
            outputs.append(InvalidInput(str(event["refuse"]), "refused by the test"))
        elif "fail" in event:
            outputs.append(ValueError(str(event["fail"])))
        else:
            mine = {"id": event.get("id"), "batch": ids, "size": len(ids)}
            outputs.append({**mine, "request_id": ctx.request_id})
    return outputs


@handler("batch_gated", batch=POLICY)
def batch_gated(events: list[Any], ctxs: list[Context]) -> list[Any]:
    for event in events:
        if isinstance(event, dict):
            _hold(event)
    return _outputs(events, ctxs)


@handler("batch_async", batch=POLICY)
async def batch_async(events: list[Any], ctxs: list[Context]) -> list[Any]:
    if any(isinstance(e, dict) and e.get("exit") for e in events):
        raise SystemExit(2)  # as argparse does on bad input
    return _outputs(events, ctxs)


@handler("batch_raises", batch=POLICY)
def batch_raises(events: list[Any], ctxs: list[Context]) -> list[Any]:
    raise ValueError(f"the whole batch of {len(events)} failed")


@handler("batch_miscounts", batch=POLICY)
def batch_miscounts(events: list[Any], ctxs: list[Context]) -> list[Any]:
    return [{"n": i} for i in range(len(events) - 1)]


class Ledger:
    """The `ledger` model: nothing but its tensor count."""

    def __init__(self, tensors: int) -> None:
        self.tensors = tensors


@bundle("ledger")
def build_ledger(weights: dict[str, Any]) -> Ledger:
    return Ledger(len(weights))


@handler("batch_ledger", uses=["ledger"], batch=POLICY, warmup=[{"id": "warm-up"}])
def batch_ledger(events: list[Any], ledger: Ledger, ctxs: list[Context]) -> list[Any]:
    for event in events:
        if isinstance(event, dict):
            _hold(event)
    return _outputs(events, ctxs)

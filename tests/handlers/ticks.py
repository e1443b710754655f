"""Generator handlers that stream ticks and count them, so a test sees when one stops.

`ticks` (a sync generator) and `aticks` (an async one) yield `{"text": "t<i> "}`
for i in 0..n-1, and are joined to `{"text": all of them, "ticks": n}`. Event
(all optional): `n` (default 5), `gap_s` seconds between ticks, `fail_at` an
index at which to raise RuntimeError instead of yielding, `hold` a path and
`hold_at` an index: before that tick the run waits while the file exists (a
test holds a stream midway until it removes it).

With THAW_TEST_TICK_LOG set, each tick appends `tick <i>` to that file before
it is yielded, and the run's end appends `end <ticks yielded> <how>`: how is
`done`, `closed` (the generator was closed or cancelled: its caller went away)
or `failed`. One write per line, O_APPEND.

`model_ticks` is `ticks` using the bundle `tick-model`, whose builder sleeps
its config's `sleep_s`, then waits while the file its config's `hold` names
exists: a stream that must wait for a load.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from runtime import Context, bundle, handler


def _log(line: str) -> None:
    path = os.environ.get("THAW_TEST_TICK_LOG")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def join_ticks(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"text": "".join(item["text"] for item in items), "ticks": len(items)}


def _plan(event: Any) -> tuple[int, float, int, str, int]:
    event = event if isinstance(event, dict) else {}
    return (
        int(event.get("n", 5)),
        float(event.get("gap_s", 0.0)),
        int(event.get("fail_at", -1)),
        str(event.get("hold", "")),
        int(event.get("hold_at", -1)),
    )


@handler("ticks", join=join_ticks)
def ticks(event: Any, ctx: Context) -> Iterator[dict[str, Any]]:
    n, gap_s, fail_at, hold, hold_at = _plan(event)
    count, how = 0, "closed"
    try:
        for i in range(n):
            if i == hold_at:
                while hold and Path(hold).exists():
                    time.sleep(0.01)
            if i == fail_at:
                how = "failed"
                raise RuntimeError(f"tick {i} failed")
            if i and gap_s:
                time.sleep(gap_s)
            _log(f"tick {i}")
            count += 1
            yield {"text": f"t{i} "}
        how = "done"
    finally:
        _log(f"end {count} {how}")


@handler("aticks", join=join_ticks)
async def aticks(event: Any, ctx: Context) -> AsyncIterator[dict[str, Any]]:
    n, gap_s, fail_at, hold, hold_at = _plan(event)
    count, how = 0, "closed"
    try:
        for i in range(n):
            if i == hold_at:
                while hold and Path(hold).exists():
                    await asyncio.sleep(0.01)
            if i == fail_at:
                how = "failed"
                raise RuntimeError(f"tick {i} failed")
            if i and gap_s:
                await asyncio.sleep(gap_s)
            _log(f"tick {i}")
            count += 1
            yield {"text": f"t{i} "}
        how = "done"
    finally:
        _log(f"end {count} {how}")


@bundle("tick-model")
def build_tick_model(config: dict[str, Any]) -> dict[str, Any]:
    time.sleep(float(config.get("sleep_s", 0.0)))
    hold = config.get("hold")
    while hold and Path(hold).exists():  # a test holds the load until it removes the file
        time.sleep(0.01)
    return dict(config)


@handler("model_ticks", uses=["tick-model"], join=join_ticks)
def model_ticks(event: Any, model: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
    yield from ticks(event, ctx)

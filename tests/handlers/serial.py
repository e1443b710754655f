"""`serial`: a handler declared one call at a time, as code that holds a GPU's one
batch, or is not thread-safe, is: `Batch(max_size=1, max_wait_ms=0, max_concurrent=1)`.

Each event (all keys optional): `tag` names the run; `s` seconds to sleep; `hold`
a path: the run waits while that file exists, so a test holds the handler busy
until it removes the file. Each run appends `<tag> start <pid> <t>` as it begins
and `<tag> end <pid> <t>` as it returns to the file `THAW_TEST_RUN_LOG`, with `t`
from `time.monotonic()`: one clock for every process of the machine, so runs of
several instances can be laid on one line. One `os.write` per line (O_APPEND):
concurrent runs and processes never interleave within a line.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import Batch, Context, handler
from tests.handlers.runlog import append

ONE_AT_A_TIME = Batch(max_size=1, max_wait_ms=0, max_concurrent=1)


def _run(event: Any, ctx: Context) -> dict[str, Any]:
    event = event if isinstance(event, dict) else {}
    tag = str(event.get("tag", ctx.request_id))
    append(f"{tag} start {os.getpid()} {time.monotonic()!r}")
    hold = event.get("hold")
    while hold and Path(hold).exists():
        time.sleep(0.01)
    time.sleep(float(event.get("s", 0.0)))
    append(f"{tag} end {os.getpid()} {time.monotonic()!r}")
    return {"tag": tag, "pid": os.getpid()}


@handler("serial", batch=ONE_AT_A_TIME)
def serial(events: list[Any], ctxs: list[Context]) -> list[Any]:
    return [_run(event, ctx) for event, ctx in zip(events, ctxs, strict=True)]


@dataclass(frozen=True)
class Run:
    tag: str
    pid: int
    start: float
    end: float | None


def runs(log: Path) -> list[Run]:
    """Every run in the log, in the order they started (`end` None: still running)."""
    starts: dict[tuple[str, int], float] = {}
    ends: dict[tuple[str, int], float] = {}
    order: list[tuple[str, int]] = []
    text = log.read_text() if log.exists() else ""
    for line in text.splitlines():
        tag, what, pid, at = line.split()
        key = (tag, int(pid))
        if what == "start":
            order.append(key)
            starts[key] = float(at)
        else:
            ends[key] = float(at)
    return sorted(
        (Run(tag, pid, starts[(tag, pid)], ends.get((tag, pid))) for tag, pid in order),
        key=lambda run: run.start,
    )


def overlaps(log: Path) -> list[tuple[Run, Run]]:
    """Pairs of runs of one process that overlapped: each breaks the declared
    one-at-a-time capacity."""
    found = []
    by_pid: dict[int, list[Run]] = {}
    for run in runs(log):
        by_pid.setdefault(run.pid, []).append(run)
    for pid_runs in by_pid.values():
        for earlier, later in itertools.pairwise(pid_runs):
            if earlier.end is None or later.start < earlier.end:
                found.append((earlier, later))
    return found

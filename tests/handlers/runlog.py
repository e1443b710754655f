"""`logged`: one line per run in the file `THAW_TEST_RUN_LOG`, so a test can count runs.

Event (all optional): `tag` names the run in the log; `s` seconds to sleep;
`hold` a path: the run waits while that file exists (a test holds a job running
until it removes it); `fail` true: raise after the sleep. Each run appends
`<tag> start <pid> <epoch s>` when it begins and `<tag> end <pid> <epoch s>`
when it returns. The output carries the tag, the pid and the start time.

The log is written with O_APPEND in one write per line, so concurrent runs and
processes never interleave within a line; it lives outside any filesystem a
test fills, so it keeps counting while the job store cannot write.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from runtime import Context, handler


def append(line: str) -> None:
    """One line onto `THAW_TEST_RUN_LOG` (if set), in one write."""
    path = os.environ.get("THAW_TEST_RUN_LOG")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


@handler("logged")
def logged(event: Any, ctx: Context) -> dict[str, Any]:
    event = event if isinstance(event, dict) else {}
    tag = str(event.get("tag", ctx.request_id))
    started = time.time()
    append(f"{tag} start {os.getpid()} {started!r}")
    hold = event.get("hold")
    while hold and Path(hold).exists():
        time.sleep(0.02)
    time.sleep(float(event.get("s", 0.0)))
    if event.get("fail"):
        append(f"{tag} end {os.getpid()} {time.time()!r}")
        raise RuntimeError(f"injected failure of run {tag}")
    append(f"{tag} end {os.getpid()} {time.time()!r}")
    return {"tag": tag, "pid": os.getpid(), "started": started}


def runs(log: Path, tag: str) -> list[tuple[int, float]]:
    """(pid, start time) of each run of `tag` in the log, in order."""
    if not log.exists():
        return []
    found = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == tag and parts[1] == "start":
            found.append((int(parts[2]), float(parts[3])))
    return found

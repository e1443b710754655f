"""`write_file`: writes `event["text"]` to `event["path"]`, an effect a test can see.

`flaky`: fails while the file `event["path"]` holds fewer than `event["fail_times"]`
lines, appending one line per attempt, so retries can be counted.

`while_file`: returns once the file `event["path"]` is gone (a test holds a call
past any wait until it removes it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from runtime import Context, handler


@handler("write_file")
def write_file(event: Any, ctx: Context) -> dict[str, Any]:
    Path(event["path"]).write_text(str(event.get("text", "")))
    return {"written": event["path"]}


@handler("flaky")
def flaky(event: Any, ctx: Context) -> dict[str, Any]:
    path = Path(event["path"])
    attempts = len(path.read_text().splitlines()) if path.exists() else 0
    with path.open("a") as handle:
        handle.write(f"{ctx.request_id}\n")
    if attempts < int(event.get("fail_times", 0)):
        raise RuntimeError(f"attempt {attempts + 1} fails on purpose")
    return {"attempts": attempts + 1}


@handler("while_file")
def while_file(event: Any, ctx: Context) -> dict[str, Any]:
    path = Path(event["path"])
    for _ in range(6000):  # a minute at most: no test holds one longer
        if not path.exists():
            return {"released": True}
        time.sleep(0.01)
    raise TimeoutError(f"{path} was never removed")

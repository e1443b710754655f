"""`crashes`: the process exits mid-invocation, as a segfaulting extension would."""

from __future__ import annotations

import os
from typing import Any

from runtime import Context, handler


@handler("crashes")
def crashes(event: Any, ctx: Context) -> Any:
    os._exit(int(event.get("code", 3)))

"""`environ`: answers which of the named environment variables handler code can read."""

from __future__ import annotations

import os
from typing import Any

from runtime import Context, handler


@handler("environ")
def environ(event: Any, ctx: Context) -> dict[str, Any]:
    return {name: os.environ.get(name) for name in event.get("names", [])}

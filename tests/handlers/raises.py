"""`raises`: user code that raises ValueError(event["message"])."""

from __future__ import annotations

from typing import Any

from runtime import Context, handler


@handler("raises")
def raises(event: Any, ctx: Context) -> Any:
    message = event.get("message", "boom") if isinstance(event, dict) else "boom"
    raise ValueError(message)

"""`echo`: returns its event; no model."""

from __future__ import annotations

from typing import Any

from runtime import Context, handler


@handler("echo")
def echo(event: Any, ctx: Context) -> Any:
    return event

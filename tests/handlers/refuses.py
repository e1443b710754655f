"""`refuses`: user code that rejects its event with InvalidInput (a Thaw error of its own)."""

from __future__ import annotations

from typing import Any

from runtime import Context, InvalidInput, handler


@handler("refuses")
def refuses(event: Any, ctx: Context) -> Any:
    raise InvalidInput("value", "must be a number")

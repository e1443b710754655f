"""`unserialisable`: returns an output JSON has no form for (a set)."""

from __future__ import annotations

from typing import Any

from runtime import Context, handler


@handler("unserialisable")
def unserialisable(event: Any, ctx: Context) -> Any:
    return {"tags": {"a", "b"}}

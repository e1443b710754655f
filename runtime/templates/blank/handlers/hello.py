"""`hello`: a handler with no model, the smallest function Thaw serves.

Add a model: build a bundle into bundles/ (bundles/README.md), write its
builder with `@bundle("NAME")`, and name it in the handler's `uses`.
"""

from __future__ import annotations

from typing import Any

from runtime import Context, InvalidInput, handler


@handler("hello", warmup=[{"name": "warm-up"}])
def hello(event: Any, ctx: Context) -> dict[str, str]:
    """Greet `name`."""
    name = event.get("name") if isinstance(event, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidInput("name", "must be a non-empty string")
    return {"greeting": f"hello, {name}", "request_id": ctx.request_id}

"""`client_context`: answers what the handler's Context carries from its caller."""

from __future__ import annotations

from typing import Any

from runtime import Context, handler


@handler("client_context")
def client_context(event: Any, ctx: Context) -> Any:
    return {"client_context": ctx.client_context, "request_id": ctx.request_id}

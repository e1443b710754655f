"""`echo`: returns its event. No model; the smallest possible handler."""

from typing import Any

from runtime import Context, handler


@handler("echo")
def echo(event: Any, ctx: Context) -> Any:
    """Return the event unchanged."""
    return event

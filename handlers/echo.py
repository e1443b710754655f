"""`echo`: returns its event. No model; the smallest possible handler.

It is `async def` because it never blocks: async handlers run on the event
loop, while a plain `def` handler runs in a worker thread so that it cannot
stall the loop, at the price of two thread hand-offs per call.
"""

from typing import Any

from runtime import Context, handler


@handler("echo")
async def echo(event: Any, ctx: Context) -> Any:
    """Return the event unchanged."""
    return event

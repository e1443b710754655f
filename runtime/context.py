"""What a handler receives beside its event and models."""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from runtime.clock import SYSTEM, Clock

# The ClientContext of the Lambda invocation being served, decoded (None: none).
# Set by the Lambda loop (runtime/aws/lambda_loop.py) around the in-process
# request it makes of the app, which runs in the loop's own task: no HTTP header
# carries it, so no HTTP caller can set it, as on Lambda, where only an Invoke
# API call has one (a Function URL request has none).
CLIENT_CONTEXT: ContextVar[Any] = ContextVar("thaw_client_context", default=None)


# Slotted, not frozen: one is built per request, and a frozen dataclass's
# __init__ sets each field through object.__setattr__.
@dataclass(slots=True)
class Context:
    """Request id, deadline and a logger for one invocation, and the caller's client context."""

    request_id: str
    handler: str
    # The `clock.monotonic()` value by which the caller wants an answer; None = no deadline.
    deadline_at: float | None = None
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("thaw.handler"))
    warmup: bool = False
    # What the caller sent as Lambda's ClientContext (the Invoke API's
    # X-Amz-Client-Context, handed on by the Runtime API and `CLIENT_CONTEXT`),
    # decoded: as a rule an object, e.g. {"custom": {...}, "env": {...}}. None
    # when there is none (always over HTTP). Caller data, as untrusted as the event.
    client_context: Any = None
    # The id the caller knows this request by: its own X-Request-Id (a correlation
    # id, which two requests may share), else `request_id`; what log lines name.
    # `request_id` itself is unique to the request (runtime/http/edge.py).
    correlation_id: str | None = None
    # The instance's clock, which `deadline_at` is on (the dispatcher passes its own).
    clock: Clock = SYSTEM

    def remaining_s(self) -> float | None:
        """Seconds left before the caller's deadline (None when there is none)."""
        if self.deadline_at is None:
            return None
        return max(0.0, self.deadline_at - self.clock.monotonic())

"""What a handler receives beside its event and models."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field


# Slotted, not frozen: one is built per request, and a frozen dataclass's
# __init__ sets each field through object.__setattr__.
@dataclass(slots=True)
class Context:
    """Request id, deadline and a logger for one invocation."""

    request_id: str
    handler: str
    # time.monotonic() value by which the caller wants an answer; None = no deadline.
    deadline_at: float | None = None
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("thaw.handler"))
    warmup: bool = False

    def remaining_s(self) -> float | None:
        """Seconds left before the caller's deadline (None when there is none)."""
        if self.deadline_at is None:
            return None
        return max(0.0, self.deadline_at - time.monotonic())

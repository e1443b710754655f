"""Held connections (`Holds`): requests that wait on purpose, bounded in total and per key.

A job long-poll (`GET /jobs/{id}?wait=S`), a job follow and an invocation's
event stream (`Accept: text/event-stream`) each hold a connection, and with
it a file handle, for as long as they wait. Each takes a hold first: past
THAW_MAX_HELD_PER_KEY holds of its key it is answered 429 `quota-exceeded`,
past THAW_MAX_HELD in all 503 `overloaded`, both at once and with
Retry-After, so one tenant holding hundreds of waits cannot take the process's
file handles (or its other tenants' turns) and `/healthz`, which never holds,
answers beside them. An invocation that merely waits for its answer is
bounded by its handler's queue (THAW_MAX_QUEUE) instead, and every wait, by
`?wait=` or `Prefer: wait`, by THAW_MAX_WAIT_S. Without keys (auth off:
loopback, Lambda) there are no tenants to tell apart: only THAW_MAX_HELD holds.
"""

from __future__ import annotations

from runtime.errors import Overloaded, QuotaExceeded

# Holds end as waits do: seconds, not minutes.
_RETRY_AFTER_S = 1.0


class Holds:
    """The holds taken and not yet given back, in all and by key id."""

    def __init__(self, total: int, per_key: int) -> None:
        self.total = total
        self.per_key = per_key
        self.held = 0
        self.by_key: dict[str, int] = {}

    def take(self, key_id: str | None) -> None:
        """One more hold for `key_id`, or the refusal of one past its limits."""
        mine = self.by_key.get(key_id, 0) if key_id is not None else 0
        if mine >= self.per_key:
            raise QuotaExceeded(
                f"this key holds {mine} waiting connections, "
                f"THAW_MAX_HELD_PER_KEY={self.per_key}; wait for one to end",
                limit=self.per_key,
                retry_after_s=_RETRY_AFTER_S,
            )
        if self.held >= self.total:
            raise Overloaded(
                f"{self.held} waiting connections are held, THAW_MAX_HELD={self.total}",
                limit=self.total,
                retry_after_s=_RETRY_AFTER_S,
            )
        if key_id is not None:
            self.by_key[key_id] = mine + 1
        self.held += 1

    def give(self, key_id: str | None) -> None:
        """Give back a hold `take` granted."""
        self.held -= 1
        if key_id is None:
            return
        left = self.by_key[key_id] - 1
        if left:
            self.by_key[key_id] = left
        else:
            del self.by_key[key_id]

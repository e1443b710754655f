"""What keeps this instance from being ready, apart from prewarm and drain.

Two kinds of condition:

    transient   a resource the instance needs is failing (the job store cannot
                write): readiness is off while it lasts; it is logged once when it
                starts and once when it ends, never per request
    wedged      a thread of user code (a builder, a warm-up, a handler) stopped
                making progress past its deadline. A Python thread cannot be
                killed, and what it holds (a model, its memory) cannot be
                reclaimed, so readiness goes off for good and `on_wedged` runs
                once: the instance drains and exits, and the platform replaces it

Changed on the event loop thread only (`report` callers from threads use
`loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from runtime.clock import SYSTEM, Clock

log = logging.getLogger("thaw.health")


@dataclass
class Condition:
    name: str
    detail: str
    # When it began: epoch seconds for display, and on the monotonic clock for its duration.
    since: float
    began: float


class Health:
    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self.conditions: dict[str, Condition] = {}
        self.wedged: Condition | None = None
        self.on_wedged: Callable[[Condition], object] | None = None

    @property
    def ok(self) -> bool:
        return self.wedged is None and not self.conditions

    def report(self, name: str, detail: str) -> None:
        """Condition `name` holds (logged when it starts, not again while it lasts)."""
        if name not in self.conditions:
            self.conditions[name] = self._condition(name, detail)
            log.error("unready: %s: %s", name, detail)

    def clear(self, name: str) -> None:
        condition = self.conditions.pop(name, None)
        if condition is not None:
            lasted_s = self.clock.monotonic() - condition.began
            log.warning("ready again: %s ended after %.1f s", name, lasted_s)

    def wedge(self, detail: str) -> None:
        """A thread is stuck for good: unready until the process exits."""
        if self.wedged is not None:
            return
        self.wedged = self._condition("wedged", detail)
        log.critical("wedged: %s; draining, then exiting so the platform replaces it", detail)
        if self.on_wedged is not None:
            self.on_wedged(self.wedged)

    def _condition(self, name: str, detail: str) -> Condition:
        return Condition(name, detail, since=self.clock.wall(), began=self.clock.monotonic())

    def describe(self) -> list[dict[str, object]]:
        shown = [self.wedged] if self.wedged is not None else []
        shown += list(self.conditions.values())
        return [{"condition": c.name, "detail": c.detail, "since": c.since} for c in shown]

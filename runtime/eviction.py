"""Which idle bundle leaves memory first when a new one needs room.

The cache hands a policy the idle, unpinned resident bundles; the policy
returns them in eviction order. Bundles in use and pinned (prewarm) bundles
are never offered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    name: str
    size_bytes: int
    # Measured seconds the last load took (fetch through warm-up).
    reload_s: float
    last_used_at: float  # time.monotonic()
    hits: int


class EvictionPolicy(Protocol):
    def order(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        """Candidates in the order they should be evicted."""
        ...


class LRUPolicy:
    """Least recently used first."""

    def order(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        return sorted(candidates, key=lambda c: c.last_used_at)

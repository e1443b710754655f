"""Which idle bundle leaves memory first when a new one needs room.

The cache hands a policy the idle, unpinned resident bundles; the policy
returns them in eviction order and the cache evicts from the front until the
newcomer fits. Bundles in use and pinned (prewarm) bundles are never offered.
The cache also tells the policy when a bundle became READY, was used, and was
evicted, so a policy can keep state between decisions.

The keep-versus-evict rule: evicting b costs its reload seconds R on each of
its later requests, i.e. R/T reload-seconds per second for a bundle requested
every T seconds, and keeping it costs its S bytes of the budget. So the
bundle to evict is the one of lowest density (R/T)/S, the reload time per
second that each GiB it holds saves; a bundle stays while its density is
above that of the bundles competing for its room.

`DensityPolicy` computes that density directly: 1/T is estimated per bundle
as an exponentially decayed request rate (time constant `rate_window_s`, one
hour by default), kept when the bundle is evicted, so a bundle that comes
back is judged by its history and a bundle nobody uses any more fades out.
`GDSFPolicy` is GreedyDual-Size-Frequency (Cherkasova, 1998), the earlier
default: priority = clock + frequency * R / S with frequency counted since
the bundle entered memory and the clock rising to each evicted priority. Its
frequency restarts at every reload, so it forgets what it learnt each time a
popular bundle is pushed out; on the simulator's i.i.d. trace the density
estimate matches the policy that knows the true popularity, GDSF trails it.

Both apply hysteresis: a bundle used within `min_residency_s` goes to the
back of the order, so it is evicted only when the older ones do not free
enough; a burst of loads cannot flush what was just used (and reload it
right after). `LRUPolicy` is the reference for the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

_GIB = float(1 << 30)


@dataclass(frozen=True)
class Candidate:
    name: str
    size_bytes: int
    # Measured seconds the last load took (fetch through warm-up), excluding the
    # process's one-time framework import, which a reload does not pay again.
    reload_s: float
    last_used_at: float  # the cache's clock.monotonic()
    hits: int


class EvictionPolicy(Protocol):
    def on_load(self, candidate: Candidate, now: float) -> None:
        """`candidate` became READY (the request that waited for it follows with on_hit)."""
        ...

    def on_hit(self, candidate: Candidate, now: float) -> None:
        """A request acquired `candidate` while it was READY."""
        ...

    def on_evict(self, candidate: Candidate, now: float) -> None:
        """The cache evicted `candidate` (it was first in `order`)."""
        ...

    def order(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        """Candidates in the order they should be evicted."""
        ...


class LRUPolicy:
    """Least recently used first; no state of its own."""

    def on_load(self, candidate: Candidate, now: float) -> None:
        pass

    def on_hit(self, candidate: Candidate, now: float) -> None:
        pass

    def on_evict(self, candidate: Candidate, now: float) -> None:
        pass

    def order(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        return sorted(candidates, key=lambda c: c.last_used_at)


class GDSFPolicy:
    """GreedyDual-Size-Frequency over measured reload seconds, with a residency floor."""

    def __init__(self, *, min_residency_s: float = 30.0, min_cost_s: float = 0.25) -> None:
        self.min_residency_s = min_residency_s
        # Reload costs below this count as this: a miss costs the caller at least
        # a trip through the cold path, and differences between loads of a few
        # milliseconds are measurement noise, not a reason to keep one bundle.
        self.min_cost_s = min_cost_s
        self.clock = 0.0
        self._frequency: dict[str, int] = {}
        self._priority: dict[str, float] = {}

    def value(self, candidate: Candidate, frequency: int) -> float:
        """frequency * reload seconds per GiB held: the reload time keeping it saves per byte."""
        cost_s = max(candidate.reload_s, self.min_cost_s)
        return frequency * cost_s / max(candidate.size_bytes / _GIB, 1e-9)

    def priority(self, candidate: Candidate) -> float:
        found = self._priority.get(candidate.name)
        if found is None:  # offered before any hook saw it: as if just loaded
            return self.clock + self.value(candidate, 1)
        return found

    def _refresh(self, candidate: Candidate) -> None:
        frequency = self._frequency.get(candidate.name, 0)
        self._priority[candidate.name] = self.clock + self.value(candidate, max(1, frequency))

    def on_load(self, candidate: Candidate, now: float) -> None:
        # Frequency counts requests since this bundle (re)entered memory, as in
        # GDSF: a count carried over from an old life would pin a bundle that
        # was popular once and keep it above the rising clock for a long time.
        self._frequency[candidate.name] = 0
        self._refresh(candidate)

    def on_hit(self, candidate: Candidate, now: float) -> None:
        self._frequency[candidate.name] = self._frequency.get(candidate.name, 0) + 1
        self._refresh(candidate)

    def on_evict(self, candidate: Candidate, now: float) -> None:
        self.clock = max(self.clock, self.priority(candidate))
        self._priority.pop(candidate.name, None)
        self._frequency.pop(candidate.name, None)

    def order(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        def key(c: Candidate) -> tuple[bool, float, float]:
            recent = now - c.last_used_at < self.min_residency_s
            return (recent, self.priority(c), c.last_used_at)

        return sorted(candidates, key=key)


class DensityPolicy:
    """Evict the lowest (R/T)/S first, T from a decayed request rate; residency floor."""

    def __init__(
        self,
        *,
        min_residency_s: float = 30.0,
        min_cost_s: float = 0.25,
        rate_window_s: float = 3600.0,
    ) -> None:
        self.min_residency_s = min_residency_s
        # As in GDSFPolicy: millisecond differences between tiny loads are
        # measurement noise, not a reason to keep one bundle over another.
        self.min_cost_s = min_cost_s
        # Long against the request intervals it estimates (so one request more
        # or less barely moves a bundle's rate) and short against how fast
        # popularity shifts. On the simulator's trace anything from 10 minutes
        # to 3 hours gives the same result within a point.
        self.rate_window_s = rate_window_s
        self._count: dict[str, float] = {}  # decayed request count as of _at
        self._at: dict[str, float] = {}

    def rate(self, name: str, now: float) -> float:
        """Requests per second, the decayed count over the window (0 if never used)."""
        count = self._count.get(name, 0.0)
        if not count:
            return 0.0
        age = max(0.0, now - self._at[name])
        return count * math.exp(-age / self.rate_window_s) / self.rate_window_s

    def density(self, candidate: Candidate, now: float) -> float:
        """Reload seconds per second saved per GiB held: rate * R / S."""
        cost_s = max(candidate.reload_s, self.min_cost_s)
        size_gib = max(candidate.size_bytes / _GIB, 1e-9)
        return self.rate(candidate.name, now) * cost_s / size_gib

    def on_load(self, candidate: Candidate, now: float) -> None:
        # A load is not a request: the request that waited for it follows with on_hit.
        pass

    def on_hit(self, candidate: Candidate, now: float) -> None:
        name = candidate.name
        self._count[name] = self.rate(name, now) * self.rate_window_s + 1.0
        self._at[name] = now

    def on_evict(self, candidate: Candidate, now: float) -> None:
        # The rate stays: under steady popularity it is exactly what decides
        # whether this bundle should win its room back when it returns.
        pass

    def order(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        def key(c: Candidate) -> tuple[bool, float, float]:
            recent = now - c.last_used_at < self.min_residency_s
            return (recent, self.density(c, now), c.last_used_at)

        return sorted(candidates, key=key)

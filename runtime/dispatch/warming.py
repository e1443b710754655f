"""The deadline rule for callers that cannot take a 202 (the OpenAI routes): `jobless`.

Where the rule would make a job (a load that outlasts the deadline, or work
not done by it), a jobless caller is answered 503 `warming-up` with
Retry-After instead, which the official OpenAI clients wait out and retry by
themselves. The work is not kept (nobody would collect it); the loads it
needs are, so the retry finds them done or nearer:

    does not fit -> begin the loads (single flight), answer WarmingUp(retry after
                    the estimate) at once
    late         -> cut the work off (its shielded load goes on), the same answer
"""

from __future__ import annotations

import asyncio

from runtime.errors import WarmingUp
from runtime.models.cache import ModelCache
from runtime.registry import HandlerSpec

# The official client honours a server's Retry-After up to 120 s (60 s in older
# releases); a longer one it does not retry at all. A caller still early retries again.
MAX_RETRY_AFTER_S = 60.0
MIN_RETRY_AFTER_S = 0.5


class Warming:
    """Loads begun for jobless callers who will come back."""

    def __init__(self, cache: ModelCache) -> None:
        self.cache = cache
        self._tasks: set[asyncio.Task[None]] = set()

    def refuse(self, spec: HandlerSpec, estimate_s: float, wait_s: float) -> WarmingUp:
        """Begin loading what `spec` uses that is not ready; the answer to give now."""
        cold = [name for name in spec.uses if not self.cache.is_ready(name)]
        loop = asyncio.get_running_loop()
        for name in cold:
            task = loop.create_task(self._warm(name))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        retry_after_s = min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate_s))
        if cold:
            what = f"{', '.join(cold)} loading: about {estimate_s:.1f} s more"
        else:
            what = f"the work did not finish in time (about {estimate_s:.1f} s)"
        return WarmingUp(
            f"handler {spec.name!r} cannot answer within the caller's {wait_s:g} s deadline "
            f"({what}); retry after {retry_after_s:.1f} s",
            handler=spec.name,
            retry_after_s=retry_after_s,
        )

    async def _warm(self, name: str) -> None:
        try:
            lease = await self.cache.acquire(name)
        except Exception:  # the retry meets the load's error (LoadFailed)
            return
        lease.release()

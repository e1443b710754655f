"""One bundle's state in the model cache: `Entry`.

Each bundle name has one `Entry` for the life of the instance: its lifecycle,
manifest and model object, the task of its load (if one runs), the requests
waiting for its load (what it holds of memory, and its requests in flight,
are the memory budget's: runtime/models/budget.py), and the figures eviction and the views read
(hits, loads, reload cost, last use). It also says what evicting it would free,
and how it looks in /models.

Entries are changed on the event loop thread only, by the cache and its loader.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from runtime.bundles.manifest import Manifest
from runtime.models.eviction import Candidate
from runtime.models.lifecycle import Lifecycle, State


@dataclass
class Entry:
    """One bundle's state for the life of the instance."""

    name: str
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    manifest: Manifest | None = None
    model: Any = None
    task: asyncio.Task[None] | None = None
    # Set (with LoadFailed) to abandon the load under way.
    abort: asyncio.Future[None] | None = None
    # Settled when an unload under way is done.
    unloading: asyncio.Future[None] | None = None
    built: asyncio.Event = field(default_factory=asyncio.Event)
    # Requests waiting for this entry's load. Once it is READY they acquire it
    # as soon as they run; until then it counts as in use, or a load waiting
    # for room could evict it under them, and their reload evict that load's
    # bundle in turn, forever.
    waiting: int = 0
    pinned: bool = False
    loads: int = 0
    hits: int = 0
    failures: int = 0
    retry_at: float = 0.0
    last_used_at: float = 0.0  # the cache's clock.monotonic()
    last_used_wall: float | None = None
    last_load_s: float = 0.0
    # last_load_s minus waits a reload would not repeat: the eviction policy's cost.
    reload_s: float = 0.0
    progress_bytes: int = 0
    # clock.monotonic() of the load's last sign of progress (the no-progress deadline).
    progress_at: float = 0.0
    estimated_load_s: float | None = None
    # How the last load read the weights (weights.Loaded.how): copied, mapped, device.
    weights_read: str | None = None

    @property
    def weights_bytes(self) -> int:
        return self.manifest.weights_bytes if self.manifest else 0

    @property
    def per_request_bytes(self) -> int:
        return self.manifest.per_request_bytes if self.manifest else 0

    def candidate(self) -> Candidate:
        """This entry as the eviction policy sees it: what evicting it would free when idle."""
        return Candidate(
            name=self.name,
            size_bytes=self.weights_bytes + self.per_request_bytes,
            reload_s=self.reload_s,
            last_used_at=self.last_used_at,
            hits=self.hits,
        )

    def view(self) -> dict[str, Any]:
        """This entry as /models shows it, less what the cache adds (estimate, memory)."""
        lc = self.lifecycle
        manifest = self.manifest
        view: dict[str, Any] = {
            "name": self.name,
            "id": manifest.id if manifest else None,
            "version": manifest.version if manifest else None,
            "state": str(lc.state),
            "bytes": manifest.total_bytes if manifest else None,
            "phase_ms": {k: round(v, 3) for k, v in lc.phase_ms.items()},
            "loads": self.loads,
            "weights_read": self.weights_read,
            "hits": self.hits,
            "pinned": self.pinned,
            "last_used_at": self.last_used_wall,
            "error": lc.error,
        }
        if lc.loading or (lc.state is State.STORED and self.task is not None):
            # Fetching counts the bundle's bytes arriving; loading, its weights read.
            total = manifest.total_bytes if manifest else None
            if manifest is not None and lc.state is not State.STORED:
                total = sum(f.size for f in manifest.files if f.path.endswith(".safetensors"))
            view["progress"] = {
                "phase": str(lc.state),
                "bytes": self.progress_bytes,
                "total_bytes": total,
            }
        return view

"""How long until a bundle is READY, and how long a handler runs.

Per bundle name the estimator keeps observed fetch and load bandwidth
(bytes/second) and init and warm-up seconds; per handler, run seconds. Values
are exponentially weighted so one outlier does not dominate, and persisted in
the state directory so a new instance on the same node starts with them.
Before any history: size / a conservative default bandwidth, plus a default
init time. An unwritable state directory costs the persisted estimates, never a
load: it is logged once, and the estimates live on in memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from runtime.bundles.manifest import Manifest
from runtime.models.lifecycle import LOAD_PHASES, State

log = logging.getLogger("thaw.models")
_ALPHA = 0.5
_FILE = "estimates.json"
# Floor on any remaining-phase estimate: a phase that overran its estimate is
# still expected to take a little longer, not to be done already.
_MIN_REMAINING_S = 0.05
# The phases still ahead of a load in each state (the first one under way).
_PHASES_AHEAD = {
    State.STORED: LOAD_PHASES,
    State.FETCHED: LOAD_PHASES[1:],
    State.LOADED: LOAD_PHASES[2:],
    State.INITIALIZED: LOAD_PHASES[3:],
}


@dataclass
class BundleHistory:
    fetch_bytes_s: float | None = None
    load_bytes_s: float | None = None
    init_s: float | None = None
    warmup_s: float | None = None
    loads: int = 0


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else _ALPHA * new + (1 - _ALPHA) * old


class Estimator:
    def __init__(self, state_dir: Path, *, default_bandwidth_bytes_s: float, default_init_s: float):
        self.path = state_dir / _FILE
        self.default_bandwidth_bytes_s = default_bandwidth_bytes_s
        self.default_init_s = default_init_s
        self._bundles: dict[str, BundleHistory] = {}
        self._run_s: dict[str, float] = {}
        # Importing torch and resolving the device, paid by the first load of a process.
        self._framework_s: float | None = None
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()
        # Whether the last write failed: logged when it starts failing and when it
        # works again, not on every load.
        self._unwritable = False
        self._read()

    def _read(self) -> None:
        try:
            data = orjson.loads(self.path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return
        if not isinstance(data, dict):
            return
        for name, values in dict(data.get("bundles", {})).items():
            try:
                self._bundles[name] = BundleHistory(**values)
            except TypeError:
                continue
        framework = data.get("framework_s")
        if isinstance(framework, int | float):
            self._framework_s = float(framework)
        runs = data.get("runs", {})
        if isinstance(runs, dict):
            self._run_s = {k: float(v) for k, v in runs.items() if isinstance(v, int | float)}

    def _snapshot(self) -> bytes:
        """The estimates as the file stores them; call with `_lock` held."""
        return orjson.dumps(
            {
                "bundles": {k: asdict(v) for k, v in self._bundles.items()},
                "runs": self._run_s,
                "framework_s": self._framework_s,
            }
        )

    def _write_file(self, data: bytes) -> None:
        """Write the file (with `_file_lock` held); never raises."""
        tmp = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, self.path)
        except OSError as exc:
            # Estimates are an optimisation: an unwritable state dir (full, read-only,
            # not creatable) must not fail a load. A partial file would hold space.
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not self._unwritable:
                self._unwritable = True
                log.warning(
                    "load estimates cannot be saved (%s); they are kept in memory only", exc
                )
            return
        if self._unwritable:
            self._unwritable = False
            log.info("load estimates are saved again to %s", self.path)

    def record_load(
        self, manifest: Manifest, phase_ms: dict[str, float], *, persist: bool = True
    ) -> None:
        """Fold one load's phase times into the history; `persist=False` leaves the
        file write to a later `persist()` (the cache calls it off the event loop, so
        the requests waiting for this load are not answered after a file write)."""
        size = max(1, manifest.total_bytes)
        with self._lock:
            h = self._bundles.setdefault(manifest.name, BundleHistory())
            if phase_ms.get("fetch", 0) > 0:
                h.fetch_bytes_s = _ewma(h.fetch_bytes_s, size / (phase_ms["fetch"] / 1000))
            if phase_ms.get("load", 0) > 0:
                h.load_bytes_s = _ewma(h.load_bytes_s, size / (phase_ms["load"] / 1000))
            if "init" in phase_ms:
                h.init_s = _ewma(h.init_s, phase_ms["init"] / 1000)
            if "warmup" in phase_ms:
                h.warmup_s = _ewma(h.warmup_s, phase_ms["warmup"] / 1000)
            h.loads += 1
        if persist:
            self.persist()

    def persist(self) -> None:
        """Write the estimates file now.

        Only the snapshot holds `_lock`, which the event loop takes on every
        request (record_run): a slow disk must not stall it. Writers queue on
        their own lock, so an older snapshot never overwrites a newer one.
        """
        with self._file_lock:
            with self._lock:
                data = self._snapshot()
            self._write_file(data)

    def record_framework(self, seconds: float) -> None:
        with self._lock:
            self._framework_s = _ewma(self._framework_s, seconds)

    def framework_s(self) -> float:
        return self._framework_s if self._framework_s is not None else self.default_init_s

    def record_run(self, handler: str, run_s: float) -> None:
        with self._lock:
            old = self._run_s.get(handler)
            # _ewma, inline: this runs for every request.
            self._run_s[handler] = run_s if old is None else _ALPHA * run_s + (1 - _ALPHA) * old
        # Run times are persisted with the next load, not on every request:
        # the warm path must not write files.

    def phase_estimates(self, manifest: Manifest) -> tuple[dict[str, float], str]:
        """Seconds per load phase for this bundle, and the basis ("observed" or "default")."""
        h = self._bundles.get(manifest.name)
        size = manifest.total_bytes
        default_bw = self.default_bandwidth_bytes_s
        if h is None or h.loads == 0:
            return (
                {
                    "fetch": size / default_bw,
                    "load": size / default_bw,
                    "init": self.default_init_s,
                    "warmup": self.default_init_s,
                },
                "default",
            )
        return (
            {
                "fetch": size / (h.fetch_bytes_s or default_bw),
                "load": size / (h.load_bytes_s or default_bw),
                "init": h.init_s if h.init_s is not None else self.default_init_s,
                "warmup": h.warmup_s if h.warmup_s is not None else self.default_init_s,
            },
            "observed",
        )

    def remaining_s(self, manifest: Manifest, state: State, in_state_s: float) -> float:
        """Seconds until READY from `state`, having spent `in_state_s` in it."""
        if state is State.READY:
            return 0.0
        phases, _basis = self.phase_estimates(manifest)
        ahead = _PHASES_AHEAD.get(state)
        if ahead is None:
            # FAILED/UNLOADED/UNLOADING: a full load lies ahead.
            return sum(phases.values())
        remaining = max(_MIN_REMAINING_S, phases[ahead[0]] - in_state_s)
        for phase in ahead[1:]:
            remaining += phases[phase]
        return remaining

    def run_s(self, handler: str) -> float:
        return self._run_s.get(handler, 0.0)

    def describe(self, manifest: Manifest) -> dict[str, Any]:
        phases, basis = self.phase_estimates(manifest)
        return {
            "load_s": round(sum(phases.values()), 4),
            "phases_s": {k: round(v, 4) for k, v in phases.items()},
            "basis": basis,
        }

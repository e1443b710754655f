"""The model lifecycle: one enum, one transition table, one `advance()`.

    STORED -> FETCHED -> LOADED -> INITIALIZED -> WARMED -> READY -> UNLOADING -> UNLOADED
       \\________ any failure before READY ________/ -> FAILED -> STORED (after back-off)
    UNLOADED -> STORED (the bundle may be loaded again later)

Each transition stamps the time spent since the previous one under the name of
the phase it completes, so `phase_ms` always holds the last load's timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from runtime.clock import SYSTEM, Clock


class State(StrEnum):
    STORED = "stored"
    FETCHED = "fetched"
    LOADED = "loaded"
    INITIALIZED = "initialized"
    WARMED = "warmed"
    READY = "ready"
    UNLOADING = "unloading"
    UNLOADED = "unloaded"
    FAILED = "failed"


_LOADING = (State.STORED, State.FETCHED, State.LOADED, State.INITIALIZED, State.WARMED)

TRANSITIONS: dict[State, frozenset[State]] = {
    State.STORED: frozenset({State.FETCHED, State.FAILED}),
    State.FETCHED: frozenset({State.LOADED, State.FAILED}),
    State.LOADED: frozenset({State.INITIALIZED, State.FAILED}),
    State.INITIALIZED: frozenset({State.WARMED, State.FAILED}),
    State.WARMED: frozenset({State.READY, State.FAILED}),
    State.READY: frozenset({State.UNLOADING}),
    State.UNLOADING: frozenset({State.UNLOADED}),
    State.UNLOADED: frozenset({State.STORED}),
    State.FAILED: frozenset({State.STORED}),
}

# The phase a transition completes; its duration is stamped under this name.
PHASE_OF: dict[State, str] = {
    State.FETCHED: "fetch",
    State.LOADED: "load",
    State.INITIALIZED: "init",
    State.WARMED: "warmup",
    State.READY: "ready",
    State.UNLOADED: "unload",
}

LOAD_PHASES = ("fetch", "load", "init", "warmup")


class IllegalTransition(RuntimeError):
    """A programming error: the code tried a transition the table forbids."""


@dataclass
class Lifecycle:
    """State of one bundle version in this instance, with per-phase timings."""

    state: State = State.STORED
    phase_ms: dict[str, float] = field(default_factory=dict)
    error: dict[str, str] | None = None
    clock: Clock = field(default=SYSTEM, repr=False, compare=False)
    # `clock.monotonic()` when the current state was entered (phase timings).
    entered_at: float = field(init=False)
    # `clock.wall()` of the last change, for display.
    changed_at: float = field(init=False)

    def __post_init__(self) -> None:
        self.entered_at = self.clock.monotonic()
        self.changed_at = self.clock.wall()

    def advance(self, to: State, *, error: dict[str, str] | None = None) -> float:
        """Move to `to`, returning the milliseconds spent in the previous state."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.state} -> {to} is not allowed")
        now = self.clock.monotonic()
        elapsed_ms = (now - self.entered_at) * 1000.0
        if to is State.FETCHED:
            self.phase_ms = {}
        phase = PHASE_OF.get(to)
        if phase is not None:
            self.phase_ms[phase] = elapsed_ms
        self.state = to
        self.entered_at = now
        self.changed_at = self.clock.wall()
        if to is State.FAILED:
            self.error = error
        elif to is State.FETCHED:
            self.error = None
        return elapsed_ms

    def restart_clock(self) -> None:
        """Start timing a new load from now (the entry may have idled in STORED)."""
        self.entered_at = self.clock.monotonic()

    @property
    def loading(self) -> bool:
        return self.state in _LOADING and self.state is not State.STORED

    @property
    def ready(self) -> bool:
        return self.state is State.READY

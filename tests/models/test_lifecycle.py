"""The lifecycle state machine: one table, timed transitions, illegal moves refused."""

from __future__ import annotations

import pytest

from runtime.clock import ManualClock
from runtime.models.lifecycle import TRANSITIONS, IllegalTransition, Lifecycle, State


def test_happy_path_stamps_every_phase() -> None:
    clock = ManualClock()
    lc = Lifecycle(clock=clock)
    steps = {
        State.FETCHED: 0.5,
        State.LOADED: 0.25,
        State.INITIALIZED: 2.0,
        State.WARMED: 0.125,
        State.READY: 0.0,
    }
    for state, seconds in steps.items():
        clock.advance(seconds)
        changed = clock.wall()
        assert lc.advance(state) == pytest.approx(seconds * 1000.0)
        assert lc.changed_at == changed
    assert lc.phase_ms == pytest.approx(
        {"fetch": 500.0, "load": 250.0, "init": 2000.0, "warmup": 125.0, "ready": 0.0}
    )
    lc.advance(State.UNLOADING)
    clock.advance(3.0)
    lc.advance(State.UNLOADED)
    assert lc.phase_ms["unload"] == pytest.approx(3000.0)
    lc.advance(State.STORED)
    clock.advance(10.0)  # idle in STORED: a new load is timed from its start
    lc.restart_clock()
    clock.advance(1.0)
    lc.advance(State.FETCHED)
    assert lc.phase_ms == {"fetch": pytest.approx(1000.0)}


@pytest.mark.parametrize("state", list(State))
def test_every_state_refuses_transitions_outside_the_table(state: State) -> None:
    for target in State:
        lc = Lifecycle(state=state)
        if target in TRANSITIONS[state]:
            lc.advance(target)
            assert lc.state is target
        else:
            with pytest.raises(IllegalTransition):
                lc.advance(target)
            assert lc.state is state


def test_failure_records_cause_and_allows_retry() -> None:
    lc = Lifecycle()
    lc.advance(State.FETCHED)
    lc.advance(State.FAILED, error={"type": "integrity", "message": "x"})
    assert lc.error == {"type": "integrity", "message": "x"}
    lc.advance(State.STORED)
    lc.advance(State.FETCHED)
    assert lc.error is None

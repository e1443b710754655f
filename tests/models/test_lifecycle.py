"""The lifecycle state machine: one table, timed transitions, illegal moves refused."""

from __future__ import annotations

import time

import pytest

from runtime.models.lifecycle import TRANSITIONS, IllegalTransition, Lifecycle, State


def test_happy_path_stamps_every_phase() -> None:
    lc = Lifecycle()
    for state in (State.FETCHED, State.LOADED, State.INITIALIZED, State.WARMED, State.READY):
        time.sleep(0.002)
        lc.advance(state)
    assert set(lc.phase_ms) == {"fetch", "load", "init", "warmup", "ready"}
    assert all(ms >= 1.0 for name, ms in lc.phase_ms.items() if name != "ready")
    lc.advance(State.DRAINING)
    lc.advance(State.UNLOADED)
    assert "drain" in lc.phase_ms
    lc.advance(State.STORED)


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

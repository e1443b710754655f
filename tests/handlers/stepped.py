"""`stepped`: a step-level handler with no model (decode=Decode(max_sequences=3)).

Each sequence counts from 0 for its event's `n` steps, one item per step; the
output is the list of items. `{"fail_at": k}`: its k-th step raises for it
alone; `{"refuse": true}`: prefill refuses it (InvalidInput, a 400);
`{"crash": true}`: prefill fails it with a RuntimeError (a 500, its alone);
`{"hold_at": k, "gate": NAME}`: its k-th step (and with it the whole step) waits
in the handler thread until the test sets `GATES[NAME]`.

`{"hold_file": PATH, "hold_at": k}`: the same, until PATH exists (for a test in
another process); `{"sizes": true}`: each item is `[step, sequences in that step]`;
`{"prefill_gate": NAME}`: its prefill waits until the test sets `GATES[NAME]`.

`STEPS` records the names of the sequences in every step, `RELEASED` every
sequence released, and `EVENTS` each prefill's start and end and each step's
start and end, in order, for the tests to read.

`stepped_paused` and `stepped_beside` are the same handler with another
`Decode.prefill_pause_s`: 60 s (a step always waits for a prefill in flight)
and 0 (it never does).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import Context, Decode, InvalidInput, handler

STEPS: list[list[str]] = []
RELEASED: list[str] = []
EVENTS: list[str] = []
GATES: defaultdict[str, threading.Event] = defaultdict(threading.Event)


@dataclass
class Counting:
    name: str
    n: int
    fail_at: int | None
    hold_at: int | None
    gate: str
    hold_file: str | None
    sizes: bool
    done: int = 0


class CountingSteps:
    def prefill(self, events: list[Any], ctxs: list[Context]) -> list[Any]:
        names = ",".join(str(event.get("name")) for event in events)
        EVENTS.append(f"prefill {names}")
        for event in events:
            if "prefill_gate" in event and not GATES[event["prefill_gate"]].wait(timeout=120):
                raise TimeoutError("the test never opened the prefill's gate")
        EVENTS.append(f"prefilled {names}")
        started: list[Any] = []
        for event in events:
            if event.get("refuse"):
                started.append(InvalidInput("refuse", "this sequence is refused"))
                continue
            if event.get("crash"):
                started.append(RuntimeError(f"{event['name']} crashed in its prefill"))
                continue
            started.append(
                Counting(
                    event["name"],
                    event["n"],
                    event.get("fail_at"),
                    event.get("hold_at"),
                    event.get("gate", ""),
                    event.get("hold_file"),
                    bool(event.get("sizes")),
                )
            )
        return started

    def step(self, sequences: list[Counting]) -> list[Any]:
        STEPS.append([s.name for s in sequences])
        names = ",".join(s.name for s in sequences)
        EVENTS.append(f"step {names}")
        try:
            return self._step(sequences)
        finally:
            EVENTS.append(f"stepped {names}")

    def _step(self, sequences: list[Counting]) -> list[Any]:
        out: list[Any] = []
        for s in sequences:
            s.done += 1
            if s.hold_at == s.done:
                _hold(s)
            if s.fail_at == s.done:
                out.append(RuntimeError(f"{s.name} failed at step {s.done}"))
            elif s.sizes:
                out.append([[s.done - 1, len(sequences)]])
            else:
                out.append([f"{s.name}:{s.done - 1}"])
        return out

    def finished(self, sequence: Counting) -> bool:
        return sequence.done >= sequence.n

    def release(self, sequence: Counting) -> None:
        RELEASED.append(sequence.name)


def _hold(s: Counting) -> None:
    if s.hold_file is None:
        if not GATES[s.gate].wait(timeout=120):
            raise TimeoutError("the test never opened the gate")
        return
    for _ in range(12000):  # a hang guard, not a time bound
        if Path(s.hold_file).exists():
            return
        time.sleep(0.01)
    raise TimeoutError("the test never made the hold file")


@handler("stepped", decode=Decode(max_sequences=3))
def stepped() -> CountingSteps:
    return CountingSteps()


@handler("stepped_paused", decode=Decode(max_sequences=3, prefill_pause_s=60.0))
def stepped_paused() -> CountingSteps:
    return CountingSteps()


@handler("stepped_beside", decode=Decode(max_sequences=3, prefill_pause_s=0))
def stepped_beside() -> CountingSteps:
    return CountingSteps()

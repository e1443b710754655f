"""`stepped`: a step-level handler with no model (decode=Decode(max_sequences=3)).

Each sequence counts from 0 for its event's `n` steps, one item per step; the
output is the list of items. `{"fail_at": k}`: its k-th step raises for it
alone; `{"refuse": true}`: prefill refuses it (InvalidInput, a 400);
`{"hold_at": k, "gate": NAME}`: its k-th step (and with it the whole step) waits
in the handler thread until the test sets `GATES[NAME]`.

`STEPS` records the names of the sequences in every step, and `RELEASED` every
sequence released, in order, for the tests to read.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from runtime import Context, Decode, InvalidInput, handler

STEPS: list[list[str]] = []
RELEASED: list[str] = []
GATES: defaultdict[str, threading.Event] = defaultdict(threading.Event)


@dataclass
class Counting:
    name: str
    n: int
    fail_at: int | None
    hold_at: int | None
    gate: str
    done: int = 0


class CountingSteps:
    def prefill(self, events: list[Any], ctxs: list[Context]) -> list[Any]:
        started: list[Any] = []
        for event in events:
            if event.get("refuse"):
                started.append(InvalidInput("refuse", "this sequence is refused"))
                continue
            started.append(
                Counting(
                    event["name"],
                    event["n"],
                    event.get("fail_at"),
                    event.get("hold_at"),
                    event.get("gate", ""),
                )
            )
        return started

    def step(self, sequences: list[Counting]) -> list[Any]:
        STEPS.append([s.name for s in sequences])
        out: list[Any] = []
        for s in sequences:
            s.done += 1
            if s.hold_at == s.done and not GATES[s.gate].wait(timeout=120):
                raise TimeoutError("the test never opened the gate")
            if s.fail_at == s.done:
                out.append(RuntimeError(f"{s.name} failed at step {s.done}"))
            else:
                out.append([f"{s.name}:{s.done - 1}"])
        return out

    def finished(self, sequence: Counting) -> bool:
        return sequence.done >= sequence.n

    def release(self, sequence: Counting) -> None:
        RELEASED.append(sequence.name)


@handler("stepped", decode=Decode(max_sequences=3))
def stepped() -> CountingSteps:
    return CountingSteps()

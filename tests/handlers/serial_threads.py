"""`serial_threads`: a plain sync handler, unbatched, one call at a time only because
its instance has one handler thread (THAW_HANDLER_THREADS=1): the thread limit is
its capacity.

Each event (all keys optional) is serial's (tests/handlers/serial.py: `tag`
names the run, `s` seconds to sleep, `hold` a file the run waits on while it
exists, each start and end logged to THAW_TEST_RUN_LOG for processes), plus
`gate`: the name of an event in `RUNS`, which the run waits for (in-process
tests set it), so the order of events, never timing, decides what overlaps.
`RUNS` counts the calls running now, the most that ever ran at once (`peak`),
every tag started, in order, and the thread it ran on; `RUNS.begun(tag)` is
set as that run starts.
"""

from __future__ import annotations

import threading
from typing import Any

from runtime import Context, handler
from tests.handlers.serial import _run

# A gate never opened fails the run instead of holding its thread forever.
GATE_TIMEOUT_S = 60.0


class Runs:
    """What the handler's calls did, for the test to read (reset per test)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running = 0
        self.peak = 0
        self.started: list[str] = []
        # The thread each tag ran on (in-process instances each have their own).
        self.ran_on: dict[str, threading.Thread] = {}
        self._gates: dict[str, threading.Event] = {}
        self._begun: dict[str, threading.Event] = {}

    def reset(self) -> None:
        with self._lock:
            for gate in self._gates.values():
                gate.set()  # no run of an earlier test is left holding a thread
        self.__init__()  # type: ignore[misc]

    def _event(self, events: dict[str, threading.Event], name: str) -> threading.Event:
        with self._lock:
            return events.setdefault(name, threading.Event())

    def gate(self, name: str) -> threading.Event:
        """The gate `name`: runs whose event names it wait until it is set."""
        return self._event(self._gates, name)

    def begun(self, tag: str) -> threading.Event:
        """Set once the run tagged `tag` has started."""
        return self._event(self._begun, tag)


RUNS = Runs()


@handler("serial_threads")
def serial_threads(event: Any, ctx: Context) -> dict[str, Any]:
    event = event if isinstance(event, dict) else {}
    tag = str(event.get("tag", ctx.request_id))
    with RUNS._lock:
        RUNS.running += 1
        RUNS.peak = max(RUNS.peak, RUNS.running)
        RUNS.started.append(tag)
        RUNS.ran_on[tag] = threading.current_thread()
    RUNS.begun(tag).set()
    try:
        gate = event.get("gate")
        if gate and not RUNS.gate(str(gate)).wait(GATE_TIMEOUT_S):
            raise TimeoutError(f"the test never opened gate {gate!r}")
        return _run(event, ctx)
    finally:
        with RUNS._lock:
            RUNS.running -= 1

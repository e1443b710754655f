"""The handler threads: a pool that gives each call to the thread idle last.

Sync handlers run here (runtime/dispatch/calls.py). Not on a
`concurrent.futures.ThreadPoolExecutor`, for one reason: it completes a
call's future before its thread counts itself idle, so the call that the
completion sets off (the next warm-up example, the first request after
READY, a client's next request) often finds no idle thread and starts a new
one. A new thread pays the framework's per-thread set-up on its first
forward pass (torch's OpenMP team, a malloc arena, oneDNN scratch space):
`classify`'s first call on a fresh thread took 43 ms here against 28 ms on
the thread its warm-up ran on, which is the cost warm-up exists to pay.

So a thread is marked idle *before* it completes its call, and a call goes to
the thread that became idle last (a stack, not a queue): the threads warm-up
ran on serve the first requests, the threads that served recently stay warm,
and the pool grows only when calls really overlap. Calls past `max_threads`
wait in arrival order.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

# How long a shutdown waits for an idle thread to end (it ends at once).
JOIN_S = 1.0
# A call and the future of its outcome.
_Call = tuple[Callable[[], Any], "Future[Any]"]


class HandlerThreads:
    """At most `max_threads` daemon threads named `<name>_<n>`; see the module docstring."""

    def __init__(self, max_threads: int, name: str) -> None:
        if max_threads < 1:
            raise ValueError("max_threads must be at least 1")
        self.max_threads = max_threads
        self.name = name
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # the last one idle is at the end
        self._waiting: deque[_Call] = deque()
        self.started = 0
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn()` on a handler thread; RuntimeError once shut down (as the executor's)."""
        future: Future[Any] = Future()
        call: _Call = (fn, future)
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            if self._idle:
                self._idle.pop().inbox.put(call)
            elif self.started < self.max_threads:
                self.started += 1
                worker = _Worker(self, f"{self.name}_{self.started - 1}")
                worker.inbox.put(call)
                worker.start()
            else:
                self._waiting.append(call)
        return future

    def saturated(self) -> bool:
        """Whether a call submitted now would wait for a thread (a hint: no lock taken)."""
        return not self._idle and self.started >= self.max_threads

    def _after(self, worker: _Worker) -> tuple[bool, _Call | None]:
        """A worker is done with its call: (keep running, the next call for it).
        With no call waiting it is idle from now on, before its call completes."""
        with self._lock:
            if self._waiting:
                return True, self._waiting.popleft()
            if self._closed:
                return False, None
            self._idle.append(worker)
            return True, None

    def shutdown(self) -> None:
        """Take no more calls and cancel the waiting ones; idle threads end now,
        busy ones when their call returns (a thread cannot be stopped).

        The idle ones are joined: a daemon thread still ending (the framework's
        thread-local destructors) while the process exits can abort it
        (`terminate called without an active exception`), and the interpreter
        joins only non-daemon threads before it exits."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            idle, self._idle = self._idle, []
        for _, future in waiting:
            future.cancel()
        for worker in idle:
            worker.inbox.put(None)
        for worker in idle:
            worker.join(JOIN_S)


class _Worker(threading.Thread):
    def __init__(self, pool: HandlerThreads, name: str) -> None:
        # Daemon, so an idle one never holds up the interpreter's exit; a busy one
        # is found by runtime/process.py through `running_user_code`, which
        # waits for it a moment and, if it is stuck, says so and exits past it.
        super().__init__(name=name, daemon=True)
        self.pool = pool
        self.inbox: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self.running_user_code = False

    def run(self) -> None:
        call = self.inbox.get()
        while call is not None:
            fn, future = call
            call = None  # drop the reference: the outcome may be large
            result: Any = None
            error: BaseException | None = None
            ran = future.set_running_or_notify_cancel()
            if ran:
                self.running_user_code = True
                try:
                    result = fn()
                except BaseException as exc:  # SystemExit too: it ends the call, not the thread
                    error = exc
                self.running_user_code = False
            keep_running, call = self.pool._after(self)
            if ran:
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
            del fn, future, result, error
            if not keep_running:
                return
            if call is None:
                call = self.inbox.get()

"""The handler threads: a pool that gives each call to the thread idle last.

Sync handlers run here (runtime/dispatch/executor.py). Not on a
`concurrent.futures.ThreadPoolExecutor`, for one reason: it completes a
call's future before its thread counts itself idle, so the call that the
completion sets off (the next warm-up example, the first request after
READY, a client's next request) often finds no idle thread and starts a new
one. A new thread pays the framework's per-thread set-up on its first
forward pass (torch's OpenMP team, a malloc arena, oneDNN scratch space),
which is the cost warm-up exists to pay
(docs/decisions/0004-last-idle-first-handler-threads.md).

So a thread is marked idle *before* it completes its call, and a call wakes
the thread that became idle last (a stack, not a queue): the threads warm-up
ran on serve the first requests, the threads that served recently stay warm,
and the pool grows only when calls really overlap. Calls wait in one queue, in
arrival order, and at most one thread is on its way to it at a time: a thread
that takes a call wakes the next while calls remain, and one that finishes a
call takes the next waiting before it sleeps. A burst of calls so wakes
threads one after another, each starting at once, and goes to threads already
awake where there are any. Handing each call to a thread of its own as it came
made the threads sleep and wake several times per call, and cost the server a
share of its requests/s against a bare app
(docs/decisions/0005-one-queue-for-the-handler-threads.md).

Model calls (a handler that uses models, a prefill, a decode thread's steps)
leave an OpenMP team on their thread, and two teams alive slow every parallel
loop of both (runtime/models/weights/teams.py). So at most one idle thread
keeps its team: a thread ends its team as it goes idle while other model calls
run, and an idle thread that holds one ends it (told through its inbox) when a
model call starts on another thread. Calls in a row on one thread keep the one
team they share.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from runtime.models.weights import teams

log = logging.getLogger("thaw.dispatch")

# How long a shutdown waits for an idle thread to end (it ends at once).
JOIN_S = 1.0
# A call, the future of its outcome, and whether it is model work.
_Call = tuple[Callable[[], Any], "Future[Any]", bool]
# In an idle thread's inbox: end your OpenMP team; take a call from the queue.
_RELEASE = "release"
_WAKE = "wake"


class HandlerThreads:
    """At most `max_threads` daemon threads named `<name>_<n>`; see the module docstring."""

    def __init__(
        self,
        max_threads: int,
        name: str,
        release_team: Callable[[], object] = teams.release,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        """`release_team` ends the calling thread's OpenMP team (teams.release); `now`
        is the clock that `taken_at` reads."""
        if max_threads < 1:
            raise ValueError("max_threads must be at least 1")
        self.max_threads = max_threads
        self._now = now
        # When a thread took each call from the queue (every call passes it: one
        # that found a thread free is taken at once, one behind busy threads once
        # one is free). Weak: an entry goes with its call's future.
        self._taken_at: weakref.WeakKeyDictionary[Future[Any], float] = weakref.WeakKeyDictionary()
        self.name = name
        self.release_team = release_team
        # Model calls submitted and not yet returned (running or waiting).
        self._model_calls = 0
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # the last one idle is at the end
        self._queued: deque[_Call] = deque()  # submitted, not yet taken by a thread
        self._waking = 0  # threads woken for the queue, not yet at it
        self.started = 0
        self._closed = False

    def submit(self, fn: Callable[[], Any], *, models: bool = False) -> Future[Any]:
        """Run `fn()` on a handler thread; RuntimeError once shut down (as the executor's).
        `models`: the call runs model work (it makes or keeps an OpenMP team)."""
        future: Future[Any] = Future()
        call: _Call = (fn, future, models)
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._queued.append(call)
            self._wake_one()
            if models:
                self._model_calls += 1
                # This call's thread makes or keeps the team: no idle one keeps another.
                for idle in self._idle:
                    if idle.team:
                        idle.team = False
                        idle.inbox.put(_RELEASE)
        return future

    def _wake_one(self) -> None:
        """Under the lock: wake a thread for the queue's head (the one idle last, or a
        new one within the bound), unless one is on its way already: each thread
        that takes a call wakes the next while calls remain, so a burst of calls
        wakes threads one at a time, and a thread that finishes meanwhile takes
        the next call itself."""
        if self._waking or not self._queued:
            return
        if self._idle:
            worker = self._idle.pop()
        elif self.started < self.max_threads:
            self.started += 1
            worker = _Worker(self, f"{self.name}_{self.started - 1}")
            worker.start()
        else:
            return  # the first thread to finish its call takes it
        self._waking += 1
        worker.inbox.put(_WAKE)

    def _release_team(self) -> None:
        # Ending a team only saves time: a failure must never end the thread.
        try:
            self.release_team()
        except Exception:
            log.debug("could not end a handler thread's OpenMP team", exc_info=True)

    def wrap_waiting(
        self, future: Future[Any], wrap: Callable[[Callable[[], Any]], Callable[[], Any]]
    ) -> bool:
        """If the call of `future` still waits in the queue, put `wrap(fn)` in place of its
        `fn` and say True; False once a thread has taken it (it runs as it was).
        Under the lock a thread takes calls under, so the two never cross: the
        call runs wrapped or as it was, never both. The queue is scanned: only a
        call that waited past its caller's deadline comes here, never a warm one."""
        with self._lock:
            for index, (fn, queued, models) in enumerate(self._queued):
                if queued is future:
                    self._queued[index] = (wrap(fn), queued, models)
                    return True
        return False

    def saturated(self) -> bool:
        """Whether a call submitted now would wait for a thread (a hint: no lock taken)."""
        return not self._idle and self.started >= self.max_threads

    def _after(self, worker: _Worker, models: bool, ran: bool) -> tuple[bool, _Call | None, bool]:
        """A worker is done with its call: (keep running, the next call for it, end its
        team now). With no call waiting it is idle from now on, before its call
        completes; it ends its team if other model calls run meanwhile."""
        with self._lock:
            if models:
                self._model_calls -= 1
                worker.team = worker.team or ran
            return self._next_for(worker)

    def _woken(self, worker: _Worker) -> tuple[bool, _Call | None, bool]:
        """A thread woken for a call: `_after`'s answer. The call may have gone to a
        thread that finished first; then this one is idle again."""
        with self._lock:
            self._waking -= 1
            return self._next_for(worker)

    def _next_for(self, worker: _Worker) -> tuple[bool, _Call | None, bool]:
        # Under the lock.
        if self._queued:
            call = self._queued.popleft()
            self._taken_at[call[1]] = self._now()
            self._wake_one()  # for the rest of the queue
            return True, call, False
        if self._closed:
            return False, None, False  # the thread's end ends its team
        release = worker.team and self._model_calls > 0
        if release:
            worker.team = False
        self._idle.append(worker)
        return True, None, release

    def taken_at(self, future: Future[Any]) -> float | None:
        """When a thread took the call of `future` from the queue (None: it waits
        still: see `future.running()`)."""
        return self._taken_at.get(future)

    def shutdown(self) -> None:
        """Take no more calls and cancel the waiting ones; idle threads end now,
        busy ones when their call returns (a thread cannot be stopped).

        The idle ones are joined: a daemon thread still ending (the framework's
        thread-local destructors) while the process exits can abort it
        (`terminate called without an active exception`), and the interpreter
        joins only non-daemon threads before it exits."""
        with self._lock:
            self._closed = True
            waiting, self._queued = list(self._queued), deque()
            idle, self._idle = self._idle, []
        for _, future, _ in waiting:
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
        self.inbox: queue.SimpleQueue[_Call | str | None] = queue.SimpleQueue()
        self.running_user_code = False
        # Whether it may hold an OpenMP team (a model call ran since its last release);
        # the pool's lock guards it.
        self.team = False

    def run(self) -> None:
        call: _Call | str | None = self.inbox.get()
        while call is not None:
            if isinstance(call, str):
                if call == _RELEASE:
                    self.pool._release_team()
                    call = None
                else:  # _WAKE: a call from the queue, or idle again
                    keep_running, call, release = self.pool._woken(self)
                    if not keep_running:
                        return
                    if release:
                        self.pool._release_team()
                if call is None:
                    call = self.inbox.get()
                continue
            fn, future, models = call
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
            keep_running, call, release = self.pool._after(self, models, ran)
            if ran:
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
            del fn, future, result, error
            if release:  # after the answer: it is not the caller's to wait for
                self.pool._release_team()
            if not keep_running:
                return
            if call is None:
                call = self.inbox.get()

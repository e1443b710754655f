"""The executor: the one place user code runs, and the one boundary where what it
raised becomes Thaw's error.

The schedulers decide what runs when: the dispatcher a lone call
(runtime/dispatch/dispatcher.py), the batcher a batch (batcher.py), the
decode lanes a prefill or a decode thread's steps (decode.py); warm-up runs an
example (runtime/models/loading.py). Each hands the call to `Executor.run`,
which runs it the way its handler is declared, and gets its outcome back on
the loop in a callback it names, as a done future: its result, its exception
(what user code raised, as it is: mapped by `user_error`), or cancelled.

    sync handler    a handler thread (threads.py: the thread idle last takes the
                    next call, so warm threads serve), in a copy of the
                    submitter's context, under torch.inference_mode where it
                    uses models; the outcome comes back in one
                    `call_soon_threadsafe`, straight to the callback
    async handler   on the loop, started eagerly (eager.py): a call that never
                    waits ends in its first step, and its callback runs at once
    sys.exit()      (argparse and click call it) ends that call only, never the
                    loop or a handler thread: its outcome is a failure
    shut down       the threads stopped after the call was admitted: its outcome
                    is `drained`, one loop turn later, as a thread's would be

Sync handlers do not run on the loop's default pool. That pool carries the
runtime's own blocking work (job records, manifest reads, fetches), and 64
slow handlers must not hold up a 202's job record behind them. And a thread's
outcome goes to the callback with no task in between: its request wakes one
loop turn after the thread ends, as it would after `await
loop.run_in_executor(...)`; awaiting `asyncio.to_thread` inside a task takes
two more turns.

The executor also times what it runs (THAW_RUN_TIMEOUT_S, overruns.py: one
timer for all). A scheduler names what a call runs for as it hands it over
(`run`'s `watched`: the work of a lone call, a batch's members, a sequence
whose prefill it is), each `Watched`; from then until that work ends
(`forget`, in `Work.settle`) it is watched, however many calls it takes (a
sequence goes on in the decode thread's steps). One that runs past the limit
is told so once (`Watched.overrun`): what that means for it (a work fails with
`handler-timeout`, and a sync handler's thread, which cannot be stopped,
wedges the instance) is its own. A sync call that waited for a handler
thread is timed from when one took it, not from its hand-over: a backlog
behind busy threads must not time out (and wedge the instance) without
having run at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import traceback
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any, Protocol

from runtime.clock import SYSTEM, Clock
from runtime.context import Context
from runtime.dispatch import eager
from runtime.dispatch.overruns import Overruns
from runtime.dispatch.threads import HandlerThreads
from runtime.errors import Draining, HandlerError, ThawError
from runtime.models import weights as weights_mod
from runtime.models.weights import host
from runtime.registry import HandlerSpec
from runtime.wire.render import user_traceback

log = logging.getLogger("thaw.dispatch")

ThreadOutcome = concurrent.futures.Future[Any]
# What a call's callback gets: a done future (a thread's, or the loop's for async code).
Outcome = concurrent.futures.Future[Any] | asyncio.Future[Any]
Then = Callable[[Outcome], object]
# Awaited on the loop before a handler runs: whether it may (a queued job's claim).
Gate = Callable[[], Coroutine[Any, Any, bool]]


def user_error(
    spec: HandlerSpec, ctx: Context, exc: BaseException, *, whole_batch: bool = False
) -> ThawError:
    """What the caller of `spec` gets for `exc`, raised by (or returned from) user code.

    Thaw's own errors (`ThawError`: InvalidInput's 400, a `drained`) pass as
    they are; anything else (SystemExit too: argparse and click call
    sys.exit()) becomes `handler-error`, its cause chained, logged here once
    with where it was raised. For an exception that failed a `whole_batch`, only
    the runtime's own errors pass: a handler's 4xx raised for a whole batch
    names no member, so it is a handler error too.
    """
    if isinstance(exc, _Exited):
        exc = exc.exit
    if isinstance(exc, Draining | HandlerError) or (isinstance(exc, ThawError) and not whole_batch):
        return exc
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    log.error(
        "handler %s raised %s%s",
        spec.name,
        type(exc).__name__,
        where,
        # Named as every other line about the request is (a caller's correlation id);
        # the user's frames only, as a Lambda error's stackTrace (runtime/wire/render.py).
        extra={
            "request_id": ctx.correlation_id or ctx.request_id,
            "handler": spec.name,
            "traceback": user_traceback(exc, message=False) or None,
        },
    )
    error = HandlerError(f"{type(exc).__name__}: {exc}", handler=spec.name)
    error.__cause__ = exc
    return error


class _Exited(Exception):
    """sys.exit() in async user code, carried as an ordinary failure: raised out of a
    task (or an eager first step) it would stop the event loop, and the server with it."""

    def __init__(self, exit: SystemExit) -> None:
        super().__init__(f"SystemExit: {exit}")
        self.exit = exit


async def _exits_caught(call: Coroutine[Any, Any, Any]) -> Any:
    try:
        return await call
    except SystemExit as exc:
        raise _Exited(exc) from exc


def _gated(loop: asyncio.AbstractEventLoop, gate: Gate, call: Callable[[], Any]) -> Any:
    # On the handler thread: a refused gate ended the work on the loop already.
    if asyncio.run_coroutine_threadsafe(gate(), loop).result():
        return call()
    return None


def _with_inference_mode(call: Callable[[], Any]) -> Any:
    # Entered in the handler's thread: inference mode is thread-local.
    with weights_mod.inference_mode():
        return call()


def _back_to_loop(loop: asyncio.AbstractEventLoop, then: Then, done: ThreadOutcome) -> None:
    # Not contextlib.suppress: this runs once per sync call, and a bare `try`
    # here (with no is_closed() check before it) costs measurably less.
    try:  # noqa: SIM105
        loop.call_soon_threadsafe(then, done)
    except RuntimeError:  # the loop is closed: the process is exiting, nobody waits
        pass


def copy_outcome(future: asyncio.Future[Any], done: Outcome) -> None:
    """`done`'s outcome onto `future` (unless its awaiter was cancelled and it is
    settled already)."""
    if future.done():
        return
    if done.cancelled():
        future.cancel()
    elif (exc := done.exception()) is not None:
        future.set_exception(exc)
    else:
        future.set_result(done.result())


def batch_outputs(spec: HandlerSpec, result: Any, size: int) -> list[Any]:
    """A batched handler's result for `size` events, checked: a list of `size` items."""
    if not isinstance(result, list | tuple):
        raise HandlerError(
            f"batched handler {spec.name!r} returned {type(result).__name__} for {size} "
            f"event(s); it must return a list of {size} outputs",
            handler=spec.name,
        )
    if len(result) != size:
        raise HandlerError(
            f"batched handler {spec.name!r} returned {len(result)} outputs for {size} "
            f"event(s); it must return exactly one output per event, in order",
            handler=spec.name,
        )
    return list(result)


class Watched(Protocol):
    """What a call runs for, watched for the run limit from its hand-over until it is
    forgotten (a `Work`, runtime/dispatch/work.py): a dict key, told once if it
    runs past the limit."""

    def overrun(self) -> None: ...


class Executor:
    """Runs user code (`run`): sync handlers on the handler threads, async ones on the
    loop, each run watched for `run_limit_s` on `clock`; `warm_up` runs one
    warm-up example the way a request runs."""

    def __init__(self, threads: int, *, run_limit_s: float, clock: Clock = SYSTEM) -> None:
        self._now = clock.monotonic
        self._pool = HandlerThreads(threads, "thaw-handler", now=clock.monotonic)
        self.run_limit_s = run_limit_s
        # What runs now, by what it runs for (the watched), with its start and, for a
        # sync call, its future on the handler threads.
        self.overruns: Overruns[Watched, ThreadOutcome] = Overruns(
            run_limit_s, self._overran, clock
        )
        # `Work.settle`'s, once per piece of work: the bound method itself, no frame
        # of the executor's in between.
        self.forget: Callable[[Watched], None] = self.overruns.forget

    def run(
        self,
        spec: HandlerSpec,
        call: Callable[[], Any],
        then: Then,
        gate: Gate | None = None,
        watched: Sequence[Watched] = (),
        started_at: float | None = None,
    ) -> asyncio.Future[Any] | None:
        """Run `call()`, user code of handler `spec` (for an async handler, `call()` makes
        its coroutine); `then(outcome)` runs on the loop once it ends. What it runs
        for (`watched`) is watched for the run limit from `started_at` (None: now)
        until each is forgotten (`forget`).

        An async call's future is returned (done, if it ended in its first step:
        `then` ran already); cancelling it stops the call at its next await. A
        sync call runs on a handler thread and returns None: a thread cannot be
        stopped. With a `gate`, the thread first awaits it on the loop, and runs
        the call only if it says True (a queued job's claim, made when a thread is
        free for it: claims.py).
        """
        if spec.is_async:
            if watched:  # before its first step, which may end it (and forget it)
                self.watch(watched, self._now() if started_at is None else started_at)
            outcome = eager.start(_exits_caught(call()))
            if outcome.done():
                then(outcome)
            else:
                outcome.add_done_callback(then)
            return outcome
        self.submit(spec, call, then, gate, watched, started_at)
        return None

    def submit(
        self,
        spec: HandlerSpec,
        call: Callable[[], Any],
        then: Then,
        gate: Gate | None = None,
        watched: Sequence[Watched] = (),
        started_at: float | None = None,
    ) -> ThreadOutcome | None:
        """`run` for a sync handler: the future of its call on the handler threads (None:
        they were shut down: nothing runs, nothing is watched), which
        `gate_waiting` may still gate while it waits."""
        loop = asyncio.get_running_loop()
        models = bool(spec.uses)
        if models:
            call = partial(_with_inference_mode, call)
        if gate is not None:
            call = partial(_gated, loop, gate, call)
        try:
            done = self._pool.submit(partial(contextvars.copy_context().run, call), models=models)
        except RuntimeError:  # shut down: the instance stopped after admitting this call
            refused: ThreadOutcome = concurrent.futures.Future()
            refused.set_exception(
                Draining("this instance is shutting down and runs no more handlers")
            )
            loop.call_soon(then, refused)
            return None
        done.add_done_callback(partial(_back_to_loop, loop, then))
        # Watched once submitted (its outcome comes back one loop turn later at the
        # soonest, so nothing forgets it before), with its future: see `_overran`.
        if watched:
            self.watch(watched, self._now() if started_at is None else started_at, done)
        return done

    def watch(
        self, watched: Sequence[Watched], started_at: float, call: ThreadOutcome | None = None
    ) -> None:
        """Watch each of `watched` for the run limit from `started_at` (on the clock's
        `monotonic()`), run by sync `call` (None: an async one) until it is
        forgotten: what `run` and `submit` do for what a scheduler names."""
        for run in watched:
            self.overruns.watch(run, started_at, call)

    def _overran(self, run: Watched, started_at: float, call: ThreadOutcome | None) -> None:
        """`run` has been watched `run_limit_s` since `started_at`: it overran, unless
        its sync call waited for a handler thread meanwhile. Such a call runs only
        from when a thread took it, and is watched again from there (or, waiting
        still, from now)."""
        if call is not None and not call.done():
            if not call.running():  # waits still (for a thread, or gated): look again
                self.overruns.watch(run, self._now(), call)
                return
            taken = self._pool.taken_at(call)
            if taken is not None and taken > started_at:
                self.overruns.watch_again(run, taken, call)
                return
        run.overrun()

    def gate_waiting(self, call: ThreadOutcome, gate: Gate) -> bool:
        """Gate a sync call (`submit`'s future) that still waits for a handler thread: the
        thread that takes it awaits `gate()` on the loop first, and runs the call
        only if it says True (a 202'd caller's job, recorded queued meanwhile:
        claims.py). False once a thread has taken it: it runs as it was. Only a
        call that waited comes here; a warm call with a free thread pays nothing."""
        loop = asyncio.get_running_loop()
        return self._pool.wrap_waiting(call, lambda fn: partial(_gated, loop, gate, fn))

    async def warm_up(
        self, spec: HandlerSpec, example: dict[str, Any], models: list[Any], ctx: Context
    ) -> Any:
        """Run one warm-up example the way a request of `spec` runs (the loader's
        `WarmUp`, runtime/models/loading.py): a sync handler on the handler
        threads under inference mode, an async one on the loop, and a batched
        one as a batch of one, so the path warmed is the path served. What the
        handler raises becomes Thaw's error (`user_error`)."""
        batched = spec.batch is not None
        args = ([example], *models, [ctx]) if batched else (example, *models, ctx)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if spec.is_async:
            call = partial(spec.fn, *args)
        else:
            # In a bundle window of its own, as the load's other threads are: a
            # warm-up that stalled the load goes on allocating in one (host.py).
            call = partial(host.within_window, spec.fn, *args)
        running = self.run(spec, call, partial(copy_outcome, done))
        try:
            output = await done
            if batched:
                [output] = batch_outputs(spec, output, 1)
        except asyncio.CancelledError:
            if running is not None:
                running.cancel()
            raise
        except Exception as exc:
            raise user_error(spec, ctx, exc, whole_batch=batched)  # noqa: B904 (chained inside)
        if isinstance(output, BaseException):
            # An exception in its item's place: InvalidInput is a 400, as it is.
            raise user_error(spec, ctx, output)
        return output

    def saturated(self) -> bool:
        """Whether a sync handler submitted now would wait for a handler thread."""
        return self._pool.saturated()

    def shutdown(self) -> None:
        """Start no more handlers; running ones finish on their own (threads cannot be stopped)."""
        self._pool.shutdown()

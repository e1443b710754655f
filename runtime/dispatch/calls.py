"""Calling user code: async handlers on the loop, sync ones on threads of their own,
and the one boundary where what user code raised becomes Thaw's error.

Sync handlers run on the handler threads (runtime/dispatch/threads.py: the
thread idle last takes the next call, so warm threads serve), not on the
loop's default pool.
That pool carries the runtime's own blocking work (job records, manifest
reads, fetches), and 64 slow handlers must not hold up a 202's job record
behind them.

A thread's outcome comes back to the loop in a single `call_soon_threadsafe`,
straight to a callback the submitter names: the work's own
(`Work.ran_in_thread`, runtime/dispatch/work.py), which settles it there, with
no task in between. Its request wakes one loop turn after the thread ends, as
it would after `await loop.run_in_executor(...)`. Awaiting `asyncio.to_thread`
inside the work's task takes two more turns: one to wake the task, one to
wake the request.

`user_error` is the one boundary: every outcome of user code comes back to
one place per kind of work (a thread's callback, an async handler's await, a
batch's end, a warm-up example), and each maps its exception there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import traceback
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from runtime.context import Context
from runtime.dispatch.threads import HandlerThreads
from runtime.errors import Draining, HandlerError, ThawError
from runtime.models import weights as weights_mod
from runtime.models.weights import host
from runtime.registry import HandlerSpec
from runtime.wire.render import user_traceback

log = logging.getLogger("thaw.dispatch")

ThreadOutcome = concurrent.futures.Future[Any]
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


def _gated(loop: asyncio.AbstractEventLoop, gate: Gate, call: Callable[[], Any]) -> Any:
    # On the handler thread: a refused gate ended the work on the loop already.
    if asyncio.run_coroutine_threadsafe(gate(), loop).result():
        return call()
    return None


def _with_inference_mode(call: Callable[[], Any]) -> Any:
    # Entered in the handler's thread: inference mode is thread-local.
    with weights_mod.inference_mode():
        return call()


def _back_to_loop(
    loop: asyncio.AbstractEventLoop, then: Callable[[ThreadOutcome], None], done: ThreadOutcome
) -> None:
    # Not contextlib.suppress: this runs once per sync call, and a bare `try`
    # here (with no is_closed() check before it) measured ~4k instructions less.
    try:  # noqa: SIM105
        loop.call_soon_threadsafe(then, done)
    except RuntimeError:  # the loop is closed: the process is exiting, nobody waits
        pass


def copy_outcome(future: asyncio.Future[Any], done: ThreadOutcome) -> None:
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


class HandlerCalls:
    """Calls handler code: sync handlers on the handler threads (`submit`,
    `submit_call`), async ones on the loop; `warm_up` runs one warm-up example."""

    def __init__(self, threads: int) -> None:
        self._pool = HandlerThreads(threads, "thaw-handler")

    def submit(
        self,
        spec: HandlerSpec,
        event: Any,
        models: list[Any],
        ctx: Context,
        then: Callable[[ThreadOutcome], None],
        gate: Gate | None = None,
    ) -> None:
        """Run sync handler `spec` on a handler thread; `then(outcome)` runs on the loop after.
        With a `gate`, the thread first awaits it on the loop, and runs the handler only
        if it says True (a queued job's claim: made when a thread is free for it).

        The handler runs in a copy of the submitter's context, as under
        `asyncio.to_thread`; handlers that use models run under
        torch.inference_mode, and model-less ones never touch torch. Raises
        Draining once the handler threads are shut down.
        """
        self.submit_call(spec, partial(spec.fn, event, *models, ctx), then, gate)

    def submit_call(
        self,
        spec: HandlerSpec,
        call: Callable[[], Any],
        then: Callable[[ThreadOutcome], None],
        gate: Gate | None = None,
    ) -> None:
        """`submit` for a call made already (a batch: runtime/dispatch/batcher.py)."""
        loop = asyncio.get_running_loop()
        models = bool(spec.uses)
        if models:
            call = partial(_with_inference_mode, call)
        if gate is not None:
            call = partial(_gated, loop, gate, call)
        try:
            done = self._pool.submit(partial(contextvars.copy_context().run, call), models=models)
        except RuntimeError:  # shut down: the instance stopped after admitting this call
            raise Draining("this instance is shutting down and runs no more handlers") from None
        done.add_done_callback(partial(_back_to_loop, loop, then))

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
        try:
            if spec.is_async:
                output = await spec.fn(*args)
            else:
                done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                # In a bundle window of its own, as the load's other threads are: a
                # warm-up that stalled the load goes on allocating in one (host.py).
                call = partial(host.within_window, spec.fn, *args)
                self.submit_call(spec, call, partial(copy_outcome, done))
                output = await done
            if batched:
                [output] = batch_outputs(spec, output, 1)
        except (Exception, SystemExit) as exc:
            # SystemExit too: out of this task it would stop the event loop.
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

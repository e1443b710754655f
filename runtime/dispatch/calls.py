"""Calling user code: async handlers on the loop, sync ones on threads of their own.

Sync handlers run on the handler threads (runtime/dispatch/threads.py: the
thread idle last takes the next call, so warm threads serve), not on the
loop's default pool.
That pool carries the runtime's own blocking work (job records, manifest
reads, fetches), and 64 slow handlers must not hold up a 202's job record
behind them.

A thread's outcome comes back to the loop in a single `call_soon_threadsafe`,
straight to a callback the caller names. The dispatcher finishes a warm sync
call there, with no task in between. Its request wakes one loop turn after
the thread ends, as it would after `await loop.run_in_executor(...)`.
Awaiting `asyncio.to_thread` inside the work's task takes two more turns:
one to wake the task, one to wake the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import traceback
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from runtime.context import Context
from runtime.dispatch.threads import HandlerThreads
from runtime.errors import Draining, HandlerError, ThawError
from runtime.models import weights as weights_mod
from runtime.registry import HandlerSpec

log = logging.getLogger("thaw.dispatch")

ThreadOutcome = concurrent.futures.Future[Any]


def handler_error(spec: HandlerSpec, ctx: Context, exc: BaseException) -> HandlerError:
    """Log where user code raised; the error its caller gets (the cause chained)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    log.warning(
        "handler %s raised %s%s",
        spec.name,
        type(exc).__name__,
        where,
        extra={"request_id": ctx.request_id, "handler": spec.name},
    )
    error = HandlerError(f"{type(exc).__name__}: {exc}", handler=spec.name)
    error.__cause__ = exc
    return error


def caller_error(spec: HandlerSpec, ctx: Context, exc: BaseException) -> BaseException:
    """What a caller of `spec` gets for `exc`: the runtime's own errors as they are."""
    return exc if isinstance(exc, ThawError) else handler_error(spec, ctx, exc)


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


def copy_outcome(
    future: asyncio.Future[Any],
    done: ThreadOutcome,
    map_error: Callable[[BaseException], BaseException] | None = None,
) -> None:
    """`done`'s outcome onto `future` (unless its awaiter was cancelled and it is
    settled already), an exception through `map_error` when one is given."""
    if future.done():
        return
    if done.cancelled():
        future.cancel()
    elif (exc := done.exception()) is not None:
        future.set_exception(exc if map_error is None else map_error(exc))
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


class Caller:
    """Runs handlers: `submit` (sync ones, with a callback), `call` (an awaitable), `run`."""

    def __init__(self, threads: int) -> None:
        self._pool = HandlerThreads(threads, "thaw-handler")

    def submit(
        self,
        spec: HandlerSpec,
        event: Any,
        models: list[Any],
        ctx: Context,
        then: Callable[[ThreadOutcome], None],
    ) -> None:
        """Run sync handler `spec` on a handler thread; `then(outcome)` runs on the loop after.

        The handler runs in a copy of the caller's context, as under
        `asyncio.to_thread`; handlers that use models run under
        torch.inference_mode, and model-less ones never touch torch. Raises
        Draining once the handler threads are shut down.
        """
        self.submit_call(spec, partial(spec.fn, event, *models, ctx), then)

    def submit_call(
        self, spec: HandlerSpec, call: Callable[[], Any], then: Callable[[ThreadOutcome], None]
    ) -> None:
        """`submit` for a call made already (a batch: runtime/dispatch/batcher.py)."""
        loop = asyncio.get_running_loop()
        if spec.uses:
            call = partial(_with_inference_mode, call)
        try:
            done = self._pool.submit(partial(contextvars.copy_context().run, call))
        except RuntimeError:  # shut down: the instance stopped after admitting this call
            raise Draining("this instance is shutting down and runs no more handlers") from None
        done.add_done_callback(partial(_back_to_loop, loop, then))

    def call(
        self, spec: HandlerSpec, event: Any, models: list[Any], ctx: Context
    ) -> Awaitable[Any]:
        """The handler's outcome as an awaitable.

        An async handler's errors arrive as raised; a sync handler's as the
        HandlerError they map to (`caller_error`), mapped on the way back from
        its thread.
        """
        if spec.is_async:
            result: Awaitable[Any] = spec.fn(event, *models, ctx)
            return result
        future = asyncio.get_running_loop().create_future()
        # Mapped here, as for a warm call: a SystemExit (argparse, click) re-raised
        # in a task would stop the event loop and the server with it.
        mapped = partial(caller_error, spec, ctx)
        self.submit(spec, event, models, ctx, partial(copy_outcome, future, map_error=mapped))
        return future

    async def run(self, spec: HandlerSpec, event: Any, models: list[Any], ctx: Context) -> Any:
        """`call`, awaited; what the handler raises becomes a HandlerError.

        A batched handler runs `event` as a batch of one (warm-up runs here), so
        its batched path is the one warmed."""
        if spec.batch is not None:
            return await self._run_alone(spec, event, models, ctx)
        try:
            return await self.call(spec, event, models, ctx)
        except ThawError:
            raise
        except (Exception, SystemExit) as exc:  # see Dispatcher._execute
            raise handler_error(spec, ctx, exc) from exc

    async def _run_alone(
        self, spec: HandlerSpec, event: Any, models: list[Any], ctx: Context
    ) -> Any:
        if spec.is_async:
            result = spec.fn([event], *models, [ctx])
        else:
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            call = partial(spec.fn, [event], *models, [ctx])
            self.submit_call(spec, call, partial(copy_outcome, done))
            result = done
        try:
            [output] = batch_outputs(spec, await result, 1)
        except ThawError:
            raise
        except (Exception, SystemExit) as exc:
            raise handler_error(spec, ctx, exc) from exc
        if isinstance(output, BaseException):
            # An exception in its item's place: InvalidInput is a 400, as it is.
            raise caller_error(spec, ctx, output)
        return output

    def shutdown(self) -> None:
        """Start no more handlers; running ones finish on their own (threads cannot be stopped)."""
        self._pool.shutdown()

"""Start a coroutine now, and pay for a task only if it has to wait.

`loop.create_task` costs a scheduled step, and whoever awaits the task wakes
one or two turns of the loop later: on the warm path of a handler that never
waits (an async no-op, a cached answer) that is most of the runtime's own
cost. Python 3.12 has eager tasks for this; this is the same for 3.11: the
coroutine's first step runs at once, in a copy of the caller's context, as a
task's would; a coroutine that finishes there gives an already-done future,
and one that suspends is handed, suspended, to a task that drives the rest.

The one visible difference from a task: during that first step
`asyncio.current_task()` is the caller's task.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def start(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """Run `coro` until it first waits; a future of its outcome."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    try:
        pending = context.run(coro.send, None)
    except StopIteration as stop:
        done: asyncio.Future[T] = loop.create_future()
        done.set_result(stop.value)
        return done
    except asyncio.CancelledError:
        cancelled: asyncio.Future[T] = loop.create_future()
        cancelled.cancel()
        return cancelled
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        failed: asyncio.Future[T] = loop.create_future()
        failed.set_exception(exc)
        return failed
    return loop.create_task(_Suspended(coro, pending), context=context)


def drive(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """`start` for a coroutine that reports its own outcome (the dispatcher's work
    settles itself): run it until it first waits; the task that drives the
    rest, or None when it finished there (no future made for nothing)."""
    context = contextvars.copy_context()
    try:
        pending = context.run(coro.send, None)
    except StopIteration:
        return None
    except asyncio.CancelledError:
        return None
    return asyncio.get_running_loop().create_task(_Suspended(coro, pending), context=context)


class _Suspended(Coroutine[Any, Any, Any]):
    """A coroutine past its first step, for a task to drive from there.

    The task's first `send` gets back what the coroutine yielded at its first
    step (the future it waits on), so the task waits for that future; every
    later send and throw (a cancellation) goes on to the coroutine itself.
    """

    __slots__ = ("_coro", "_pending")

    _DELIVERED: Any = object()

    def __init__(self, coro: Coroutine[Any, Any, Any], pending: Any) -> None:
        self._coro = coro
        self._pending = pending

    def send(self, value: Any) -> Any:
        pending = self._pending
        if pending is self._DELIVERED:
            return self._coro.send(value)
        self._pending = self._DELIVERED
        return pending

    def throw(self, *exc: Any) -> Any:
        self._pending = self._DELIVERED
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, Any, Any]:
        # Awaited directly (not through a task): `yield from` by hand.
        try:
            value = self.send(None)
            while True:
                try:
                    sent = yield value
                except BaseException as exc:
                    value = self.throw(exc)
                else:
                    value = self.send(sent)
        except StopIteration as stop:
            return stop.value

"""Running the event loop, and ending the process, whatever user threads do.

A Python thread cannot be stopped. A builder or a sync handler that never
returns keeps its worker thread alive, and both `asyncio.run` (its cleanup
joins the default executor's threads) and the interpreter's exit (it joins
every non-daemon thread) would wait for it forever. A server that was asked
to stop, and drained, must still exit: these two helpers make sure it does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from runtime.telemetry.logs import DEFERRED_LOGS

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, but closing the loop without joining worker threads."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        result = loop.run_until_complete(main)
        loop.run_until_complete(loop.shutdown_asyncgens())
        return result
    finally:
        asyncio.set_event_loop(None)
        loop.close()  # shuts the default executor down without waiting for it


def _busy(thread: threading.Thread) -> bool:
    """Whether the interpreter's exit would wait for `thread`, or it runs user code:
    a non-daemon thread (the default executor's: builders, warm-up), or a handler
    thread in a call (daemon threads, runtime/dispatch/threads.py, that say so)."""
    return not thread.daemon or bool(getattr(thread, "running_user_code", False))


def exit_past_stuck_threads(code: int, *, grace_s: float = 0.5) -> None:
    """If threads other than idle pool workers are still running after `grace_s`,
    end the process now with `code` (logs flushed) instead of joining them."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and _busy(t)]
    for thread in others:
        thread.join(timeout=grace_s / max(1, len(others)))
    stuck = [t.name for t in others if t.is_alive()]
    if stuck:
        logging.getLogger("thaw.process").warning(
            "exiting without %d thread(s) still running user code: %s", len(stuck), stuck
        )
        DEFERRED_LOGS.flush()  # os._exit skips atexit, which would write what is pending
        logging.shutdown()
        os._exit(code)

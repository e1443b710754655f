"""Streams: the items of one invocation of a generator handler, as they are made.

    handler thread / task                 event loop                       readers
    for item in gen: ----push(item)---->  Stream.items (+ wake readers) --> follow(): SSE,
                                          outcome done -> Stream.ended        the Lambda
                                                                             stream, jobs

A `Stream` is made by the dispatcher for every invocation of a generator
handler, streaming caller or not: the handler runs as `bind(spec)`, which
pushes each item to the stream and returns the items joined, so the deadline
rule, queue slots, leases, jobs and errors are the dispatcher's as for any
handler. The work's outcome ends the stream: its result is the final event,
its error the error event.

Items are kept for the invocation's life (a generator handler's items are
small: tokens), so a reader that comes late (`GET /jobs/{id}` with
`Accept: text/event-stream`) replays what exists and then follows. The
producer never waits for readers (there is no backpressure to the model: a
slow client costs memory for its items, never a stalled GPU); a reader
that stops reading is the transport's to notice.

`close()` (a streaming client went away) cancels the work: a sync handler's
thread sees it after its current item and closes its generator (GeneratorExit
at its `yield`); an async one is cancelled at its next await. Either way the
work's leases, and with them its memory slot, are let go of at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any

from runtime.errors import Draining
from runtime.registry import HandlerSpec


class Stream:
    """One invocation's items, its start and its end, for any number of readers."""

    def __init__(self, spec: HandlerSpec) -> None:
        self.spec = spec
        self.loop = asyncio.get_running_loop()
        self.items: list[Any] = []
        # Set when the work holds its models and goes to run (the dispatcher's `_run`),
        # or when the work ends: a streaming caller is answered from then on.
        self.started: asyncio.Future[None] = self.loop.create_future()
        self.ended = False
        self.result: Any = None
        self.error: BaseException | None = None
        # Set by `close()`: read by a handler thread after each item.
        self.closed = False
        self.outcome: asyncio.Future[Any] | None = None
        # Set when the work was cut off (its outcome cancelled: a drain, a cancelled
        # job, a caller gone) rather than ending by itself; see `_end`.
        self.cut_off = False
        self._changed = asyncio.Event()

    # ---- the producer side -------------------------------------------------

    def bind(self, spec: HandlerSpec) -> HandlerSpec:
        """`spec` as run for this stream: its items pushed here, its output their join.

        A plain handler asked for a stream runs as it is (one final event, its
        output), a batched one included: a batch is shared by many callers, and
        binding its call to one caller's stream would begin that stream alone
        (the batch queue keeps the spec of whichever request created it). Every
        stream begins where its work gets its models (the dispatcher's `_run`).
        """
        if spec.stream_fn is None:
            return spec
        return replace(spec, fn=self._run_async if spec.is_async else self._run_sync)

    def _join(self, items: list[Any]) -> Any:
        join = self.spec.join
        return join(items) if join is not None else items

    def _run_sync(self, *args: Any) -> Any:
        """On a handler thread: run the generator, pushing each item to the loop."""
        assert self.spec.stream_fn is not None
        call_soon = self.loop.call_soon_threadsafe
        call_soon(self._begin)
        items: list[Any] = []
        gen = self.spec.stream_fn(*args)
        try:
            for item in gen:
                items.append(item)
                call_soon(self._push, item)
                if self.closed:
                    break  # nobody reads it any more: the generator is closed below
        finally:
            gen.close()
        return self._join(items)

    async def _run_async(self, *args: Any) -> Any:
        assert self.spec.stream_fn is not None
        self._begin()
        items: list[Any] = []
        gen = self.spec.stream_fn(*args)
        try:
            async for item in gen:
                items.append(item)
                self._push(item)
        finally:
            await gen.aclose()
        return self._join(items)

    def _begin(self) -> None:
        if not self.started.done():
            self.started.set_result(None)

    def _push(self, item: Any) -> None:
        self.items.append(item)
        self._wake()

    # Called on the loop by whoever runs the work elsewhere (runtime/dispatch/decode.py).
    begin = _begin
    push = _push

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def attach(self, outcome: asyncio.Future[Any]) -> None:
        """End the stream with the work's outcome."""
        self.outcome = outcome
        if outcome.done():
            self._end(outcome)
        else:
            outcome.add_done_callback(self._end)

    def _end(self, outcome: asyncio.Future[Any]) -> None:
        if outcome.cancelled():
            # Cut off (a drain, a cancelled job, a caller gone): a handler thread
            # still running stops at its next item.
            self.closed = self.cut_off = True
            self.error = Draining("the stream was cut off before it finished; send it again")
        elif (exc := outcome.exception()) is not None:
            self.error = exc
        else:
            self.result = outcome.result()
        self.ended = True
        self._begin()
        self._wake()

    # ---- the reader side ---------------------------------------------------

    def close(self) -> None:
        """The streaming caller went away: stop the work (within one item)."""
        self.closed = True
        if self.outcome is not None and not self.outcome.done():
            self.outcome.cancel()

    async def wait_change(self, seen: int, timeout_s: float) -> bool:
        """Wait until there are more than `seen` items or the stream ended; False
        when `timeout_s` passed first."""
        changed = self._changed
        if len(self.items) > seen or self.ended:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await changed.wait()
                return True
        return False

    async def follow(self, start: int, idle_s: float) -> AsyncIterator[list[Any]]:
        """Items from index `start` on, in batches of what exists at each wake-up;
        an empty batch after `idle_s` without one. Ends when the stream ends."""
        seen = start
        while True:
            if await self.wait_change(seen, idle_s):
                if len(self.items) > seen:
                    batch = self.items[seen:]
                    seen += len(batch)
                    yield batch
                    continue
                if self.ended:
                    return
            else:
                yield []

    def partial(self) -> dict[str, Any]:
        """Progress of a running stream: items so far and their join (the output so far)."""
        return {"items": len(self.items), "partial_output": self._join(list(self.items))}


class Streams:
    """The running streams of this instance's jobs, by job id (for `GET /jobs/{id}`)."""

    def __init__(self) -> None:
        self._by_job: dict[str, Stream] = {}

    def hold(self, job_id: str, stream: Stream) -> None:
        self._by_job[job_id] = stream
        if stream.outcome is None or stream.outcome.done():
            self._forget(job_id, None)
        else:
            stream.outcome.add_done_callback(partial(self._forget, job_id))

    def _forget(self, job_id: str, _outcome: Any) -> None:
        self._by_job.pop(job_id, None)

    def get(self, job_id: str) -> Stream | None:
        return self._by_job.get(job_id)

"""Scheduling invocations onto sandboxes, as the Lambda service does.

- A warm sandbox with a free worker takes the invocation (the most recently
  used first). A sandbox that has answered but not yet asked for its next
  event is waited for up to REUSE_GRACE_S, so back-to-back calls stay warm.
  Otherwise a new sandbox is spawned while the function is under its sandbox
  limit (the smaller of `--max-sandboxes` and ReservedConcurrentExecutions);
  past the limit a synchronous invocation is throttled at once (`Throttled` ->
  429 TooManyRequestsException), as Lambda does, and an asynchronous one waits
  for capacity.
- Init may take max(10 s, Timeout); the invocation's own Timeout starts when
  its event is delivered by `next`. Past it the sandbox's process group is
  killed and the caller gets `Sandbox.Timedout`; a response still streaming
  then ends with that same error (its InvokeComplete's ErrorCode, a plain
  invoke's function error) and a REPORT of `Status: timeout`, never as a
  truncated stream (`Runtime.TruncatedResponse`).
- A sandbox that exits fails what it held (`Runtime.ExitError`, or the error
  it posted to /init/error) and is replaced by the next invocation.
- A sandbox idle past the idle timeout is stopped.
- The caller gets its answer when the sandbox posts it; the invocation ends,
  and its REPORT is printed, when that worker asks for its next event (or the
  sandbox is killed or exits), as Lambda bills it. With several workers per
  sandbox, a worker's `next` ends the oldest answered invocation.
- Each version of a function has sandboxes of its own (AWS_LAMBDA_FUNCTION_VERSION
  and START's `Version:` name it), all under the function's one limit; an idle
  sandbox of another version is stopped to make room for a cold start.
- Each sandbox has its own Runtime API listener (runtime_api), started
  before the sandbox and closed after it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
import uuid
from collections.abc import Coroutine, Mapping
from typing import IO, Any

from runtime.emulator.invocation import (
    Invocation,
    Outcome,
    Throttled,
    answer,
    error_payload,
    finish,
    timed_out_message,
)
from runtime.emulator.runtime_api import RuntimeListener
from runtime.emulator.sandboxes import Launcher, Sandbox, SandboxState, pump_output
from runtime.emulator.streaming import ResponseChunks
from runtime.emulator.template import FunctionConfig, Template

INIT_LIMIT_S = 10.0
# How long an invocation waits for a sandbox that has just answered to ask for
# more, before a cold start (or a throttle): sequential calls stay warm.
REUSE_GRACE_S = 0.5
STOP_GRACE_S = 2.0


class Pool:
    """Every function's sandboxes; the one owner of scheduling decisions."""

    def __init__(
        self,
        template: Template,
        *,
        max_sandboxes: int,
        idle_timeout_s: float,
        launchers: Mapping[str, Launcher],
        out: IO[str] = sys.stdout,
        echo: IO[str] = sys.stderr,
    ) -> None:
        self.template = template
        self.max_sandboxes = max_sandboxes
        self.idle_timeout_s = idle_timeout_s
        # One per PackageType: "Image" (a process or a container), "Zip" (awslambdaric).
        self.launchers = dict(launchers)
        self.out = out
        self.echo = echo
        self.sandboxes: dict[str, Sandbox] = {}
        # Each sandbox's Runtime API, until the sandbox has exited.
        self.listeners: dict[str, RuntimeListener] = {}
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.closing = False

    def limit(self, function: FunctionConfig) -> int:
        reserved = function.reserved_concurrency
        return self.max_sandboxes if reserved is None else min(reserved, self.max_sandboxes)

    def _live(self, function: FunctionConfig, version: str | None = None) -> list[Sandbox]:
        """The function's sandboxes that take work (`version`: only those running it)."""
        return [
            i
            for i in self.sandboxes.values()
            if i.function is function
            and i.state in (SandboxState.STARTING, SandboxState.RUNNING)
            and (version is None or i.version == version)
        ]

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _acquire(self, function: FunctionConfig, wait: bool, version: str) -> Sandbox:
        """A sandbox of `version` with a worker reserved for one invocation (slot taken).
        Every version's sandboxes count against the function's one limit."""
        grace_used = False
        while True:
            if self.closing:
                raise Throttled("the emulator is shutting down")
            live = self._live(function)
            free = [i for i in live if i.slots_free > 0 and i.version == version]
            if free:
                sandbox = max(free, key=lambda i: i.last_used)
                sandbox.slots_free -= 1
                return sandbox
            if not grace_used and any(i.finishing > 0 for i in self._live(function, version)):
                grace_used = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), REUSE_GRACE_S)
                continue
            spare = [i for i in live if i.idle and i.version != version]
            if len(live) >= self.limit(function) and spare:
                # Lambda counts busy environments only: an idle one of another version
                # makes room (the least recently used).
                oldest = min(spare, key=lambda i: i.last_used)
                self.stop(oldest)
                live.remove(oldest)
            if len(live) < self.limit(function):
                return await self._spawn(function, version)
            if not wait:
                raise Throttled(
                    "ReservedFunctionConcurrentInvocationLimitExceeded"
                    if function.reserved_concurrency is not None
                    else "ConcurrentInvocationLimitExceeded"
                )
            await self._changed.wait()

    async def _spawn(self, function: FunctionConfig, version: str) -> Sandbox:
        sandbox = Sandbox(function, self.launchers[function.package_type], version)
        sandbox.slots_free -= 1
        self.sandboxes[sandbox.sid] = sandbox
        listener = self.listeners[sandbox.sid] = RuntimeListener(self, sandbox.sid)
        try:
            await listener.start()
            await sandbox.start(listener.address)
        except BaseException:
            sandbox.state = SandboxState.DEAD
            self.sandboxes.pop(sandbox.sid, None)
            self._notify()
            self._close_listener(sandbox.sid)
            raise
        self._background(pump_output(sandbox, self.echo))
        self._background(self._watch(sandbox))
        return sandbox

    async def invoke(
        self,
        function: FunctionConfig,
        payload: bytes,
        *,
        wait_for_capacity: bool = False,
        client_context: str | None = None,
        request_id: str | None = None,
        version: str = "$LATEST",
        qualifier: str | None = None,
    ) -> Outcome:
        """Run one invocation of `version` (named by `qualifier`, if any) to its answer;
        raises Throttled when none can start.

        `request_id` is given for a retried asynchronous event, which keeps its id.
        """
        sandbox = await self._acquire(function, wait_for_capacity, version)
        request_id = request_id or str(uuid.uuid4())
        trace_id = f"Root=1-{int(time.time()):08x}-{uuid.uuid4().hex[:24]};Sampled=0"
        # The invoked ARN carries the qualifier it was invoked with, as on Lambda.
        arn = function.arn if qualifier is None else f"{function.arn}:{qualifier}"
        invocation = Invocation(request_id, payload, trace_id, arn, client_context, version)
        sandbox.assigned[request_id] = invocation
        sandbox.queue.put_nowait(invocation)
        return await self._supervise(sandbox, invocation)

    async def _supervise(self, sandbox: Sandbox, invocation: Invocation) -> Outcome:
        function = sandbox.function
        init_limit_s = max(INIT_LIMIT_S, function.timeout_s)
        delivered = asyncio.ensure_future(invocation.delivered.wait())
        waiters: set[asyncio.Future[Any]] = {invocation.result, delivered}
        try:
            await asyncio.wait(waiters, timeout=init_limit_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            delivered.cancel()
        if not invocation.result.done() and not invocation.delivered.is_set():
            message = f"{invocation.request_id} Init timed out after {init_limit_s:.2f} seconds"
            self._finish(sandbox, invocation, "Sandbox.Timedout", message, status="timeout")
            self.kill(sandbox)
        if invocation.result.done():
            return invocation.result.result()
        remaining_s = invocation.delivered_at + function.timeout_s - time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(invocation.result), max(0.0, remaining_s))
        except TimeoutError:
            message = timed_out_message(invocation.request_id, function.timeout_s)
            self._finish(sandbox, invocation, "Sandbox.Timedout", message, status="timeout")
            self.kill(sandbox)
            return invocation.result.result()

    # -- the Runtime API side -------------------------------------------------

    async def next(self, sid: str) -> Invocation | None:
        """Block until the sandbox's next event; None when it is being stopped."""
        sandbox = self.sandboxes.get(sid)
        if sandbox is None or sandbox.state in (SandboxState.STOPPING, SandboxState.DEAD):
            return None
        if sandbox.state is SandboxState.STARTING:
            self._background(self._measure(sandbox))
        if sandbox.poll() and sandbox.unreported:
            # The worker is back: the invocation it answered ends here.
            for _ in range(3):  # let the output pump catch up with the last lines
                await asyncio.sleep(0)
            self._end(sandbox, sandbox.unreported.popleft())
        self._notify()
        invocation: Invocation | None = await sandbox.queue.get()
        if invocation is None or invocation.result.done():
            return None
        invocation.delivered_at = time.monotonic()
        invocation.deadline_ms = int((time.time() + sandbox.function.timeout_s) * 1000)
        invocation.log_offset = sandbox.log.end
        sandbox.last_used = invocation.delivered_at
        invocation.delivered.set()
        return invocation

    async def complete(
        self,
        sid: str,
        request_id: str,
        payload: bytes,
        error_type: str | None,
        stream: ResponseChunks | None = None,
    ) -> bool:
        """A response or error was posted (or a streamed response began: `stream`);
        False when nothing awaits it."""
        sandbox = self.sandboxes.get(sid)
        invocation = sandbox.assigned.get(request_id) if sandbox else None
        if sandbox is None or invocation is None or not invocation.delivered.is_set():
            return False
        sandbox.assigned.pop(request_id, None)
        # A function error the runtime posted is an answer: Lambda's REPORT gives
        # it no Status (only a runtime that died, or timed out, gets one).
        answer(invocation, error_type, payload, None, stream)
        sandbox.unreported.append(invocation)
        deadline_s = invocation.delivered_at + sandbox.function.timeout_s
        delay_s = max(0.0, deadline_s - time.monotonic())
        loop = asyncio.get_running_loop()
        if sandbox.capacity == 1:
            # Work after the response (a 202'd job) counts against the Timeout, as on
            # Lambda, and so does the rest of a streamed response.
            loop.call_later(delay_s, self._overdue, sandbox, sandbox.polls)
        elif stream is not None:
            loop.call_later(delay_s, self._cut_stream, invocation, sandbox.function.timeout_s)
        return True

    def _overdue(self, sandbox: Sandbox, polls: int) -> None:
        if sandbox.polls == polls and sandbox.state is SandboxState.RUNNING:
            print(
                f"sandbox {sandbox.sid}: work after the response passed the "
                f"{sandbox.function.timeout_s:g} s timeout; killed",
                file=self.echo,
                flush=True,
            )
            while sandbox.unreported:
                invocation = sandbox.unreported.popleft()
                self._cut_stream(invocation, sandbox.function.timeout_s)
                self._end(sandbox, invocation, status="timeout")
            self.kill(sandbox)

    def _cut_stream(self, invocation: Invocation, timeout_s: float) -> None:
        """A response still streaming at the Timeout ends as a buffered one that timed out
        would: Sandbox.Timedout and Lambda's message, not a truncated stream."""
        sink = invocation.stream
        if sink is None or sink.ended:
            return
        message = timed_out_message(invocation.request_id, timeout_s)
        sink.end("Sandbox.Timedout", error_payload("Sandbox.Timedout", message))
        invocation.status = "timeout"

    def init_failed(self, sid: str, error_type: str, payload: bytes) -> None:
        sandbox = self.sandboxes.get(sid)
        if sandbox is not None:
            sandbox.init_error = (error_type, payload)
            self.kill(sandbox)

    def _finish(
        self,
        sandbox: Sandbox,
        invocation: Invocation,
        error_type: str | None,
        payload: bytes | str,
        *,
        status: str | None,
    ) -> None:
        """Answer and end an invocation at once (a timeout, an exit, an init error)."""
        if invocation.result.done():
            return
        sandbox.assigned.pop(invocation.request_id, None)
        if isinstance(payload, str):
            payload = error_payload(error_type or "Runtime.Unknown", payload)
        answer(invocation, error_type, payload, status)
        self._end(sandbox, invocation)

    def _end(self, sandbox: Sandbox, invocation: Invocation, status: str | None = None) -> None:
        report = finish(sandbox, invocation, status=status)
        if report is not None:
            print(report.line(), file=self.out, flush=True)

    async def _measure(self, sandbox: Sandbox) -> None:
        """Find the process whose memory the sandbox's REPORTs give (a container's, late)."""
        sandbox.memory_pid = sandbox.pid
        pid = await sandbox.launcher.runtime_pid(sandbox)
        if pid:
            sandbox.memory_pid = pid

    # -- lifecycle ------------------------------------------------------------

    def kill(self, sandbox: Sandbox) -> None:
        sandbox.state = SandboxState.STOPPING
        sandbox.signal(signal.SIGKILL)

    def stop(self, sandbox: Sandbox) -> None:
        """Ask politely, then kill: what Lambda does to an environment it retires."""
        if sandbox.state is SandboxState.DEAD:
            return
        sandbox.state = SandboxState.STOPPING
        for _ in range(sandbox.capacity):
            sandbox.queue.put_nowait(None)
        sandbox.signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        loop.call_later(STOP_GRACE_S, sandbox.signal, signal.SIGKILL)

    def _close_listener(self, sid: str) -> None:
        listener = self.listeners.pop(sid, None)
        if listener is not None:
            listener.stop()
            self._background(listener.wait_closed())

    async def _watch(self, sandbox: Sandbox) -> None:
        assert sandbox.process is not None
        code = await sandbox.process.wait()
        sandbox.state = SandboxState.DEAD
        self.sandboxes.pop(sandbox.sid, None)
        sandbox.exited.set()
        for _ in range(sandbox.capacity):
            sandbox.queue.put_nowait(None)  # ends a `next` long-poll the process left behind
        self._close_listener(sandbox.sid)
        reason = sandbox.launcher.exit_reason(code)
        while sandbox.unreported:  # answered, but the worker never came back
            self._end(sandbox, sandbox.unreported.popleft())
        for invocation in list(sandbox.assigned.values()):
            if sandbox.init_error is not None:
                error_type, payload = sandbox.init_error
                self._finish(sandbox, invocation, error_type, payload, status="error")
            else:
                message = (
                    f"RequestId: {invocation.request_id} Error: Runtime exited with error: {reason}"
                )
                self._finish(sandbox, invocation, "Runtime.ExitError", message, status="error")
        self._notify()

    async def reap_idle(self) -> None:
        """Stop sandboxes idle longer than the idle timeout, forever."""
        period_s = min(1.0, max(0.05, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            for sandbox in list(self.sandboxes.values()):
                if sandbox.idle and now - sandbox.idle_since > self.idle_timeout_s:
                    self.stop(sandbox)

    def begin_shutdown(self) -> None:
        """Stop taking work and signal every sandbox; safe to call more than once."""
        self.closing = True
        for sandbox in list(self.sandboxes.values()):
            self.stop(sandbox)
        self._notify()

    async def shutdown(self) -> None:
        started = list(self.sandboxes.values())
        self.begin_shutdown()
        waits = [i.exited.wait() for i in started]
        if waits:
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=STOP_GRACE_S)
        stragglers = list(self.sandboxes.values())
        for sandbox in stragglers:
            sandbox.signal(signal.SIGKILL)
        if stragglers:
            exits = [asyncio.ensure_future(i.exited.wait()) for i in stragglers]
            await asyncio.wait(exits, timeout=STOP_GRACE_S)
        for launcher in self.launchers.values():
            await launcher.remove([i for i in started if i.launcher is launcher])
        for sid in list(self.listeners):
            self._close_listener(sid)
        if self._tasks:
            # Listeners close and output pumps drain within a second or so.
            await asyncio.wait(list(self._tasks), timeout=STOP_GRACE_S)
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)

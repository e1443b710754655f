"""Scheduling invocations onto instances, as the Lambda service does.

- A warm instance with a free worker takes the invocation (the most recently
  used first). An instance that has answered but not yet asked for its next
  event is waited for up to REUSE_GRACE_S, so back-to-back calls stay warm.
  Otherwise a new instance is spawned while the function is under its instance
  limit (the smaller of `--max-instances` and ReservedConcurrentExecutions);
  past the limit a synchronous invocation is throttled at once (`Throttled` ->
  429 TooManyRequestsException), as Lambda does, and an asynchronous one waits
  for capacity.
- Init may take max(10 s, Timeout); the invocation's own Timeout starts when
  its event is delivered by `next`. Past it the instance's process group is
  killed and the caller gets `Sandbox.Timedout`.
- An instance that exits fails what it held (`Runtime.ExitError`, or the error
  it posted to /init/error) and is replaced by the next invocation.
- An instance idle past the idle timeout is stopped.
- The caller gets its answer when the instance posts it; the invocation ends,
  and its REPORT is printed, when that worker asks for its next event (or the
  instance is killed or exits), as Lambda bills it. With several workers per
  instance, a worker's `next` ends the oldest answered invocation.
- Each instance has its own Runtime API listener (runtime_api), started
  before the instance and closed after it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
import uuid
from collections.abc import Coroutine
from typing import IO, Any

from runtime.emulator.instances import Instance, InstanceState, Launcher, pump_output
from runtime.emulator.invocation import (
    Invocation,
    Outcome,
    Throttled,
    answer,
    error_payload,
    finish,
)
from runtime.emulator.runtime_api import RuntimeListener
from runtime.emulator.template import FunctionConfig, Template

INIT_LIMIT_S = 10.0
# How long an invocation waits for an instance that has just answered to ask for
# more, before a cold start (or a throttle): sequential calls stay warm.
REUSE_GRACE_S = 0.5
STOP_GRACE_S = 2.0


class Pool:
    """Every function's instances; the one owner of scheduling decisions."""

    def __init__(
        self,
        template: Template,
        *,
        max_instances: int,
        idle_timeout_s: float,
        launcher: Launcher,
        out: IO[str] = sys.stdout,
        echo: IO[str] = sys.stderr,
    ) -> None:
        self.template = template
        self.max_instances = max_instances
        self.idle_timeout_s = idle_timeout_s
        self.launcher = launcher
        self.out = out
        self.echo = echo
        self.instances: dict[str, Instance] = {}
        # Each instance's Runtime API, until the instance has exited.
        self.listeners: dict[str, RuntimeListener] = {}
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.closing = False

    def limit(self, function: FunctionConfig) -> int:
        reserved = function.reserved_concurrency
        return self.max_instances if reserved is None else min(reserved, self.max_instances)

    def _live(self, function: FunctionConfig) -> list[Instance]:
        return [
            i
            for i in self.instances.values()
            if i.function is function and i.state in (InstanceState.STARTING, InstanceState.RUNNING)
        ]

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _acquire(self, function: FunctionConfig, wait: bool) -> Instance:
        """An instance with a worker reserved for one invocation (slot taken)."""
        grace_used = False
        while True:
            if self.closing:
                raise Throttled("the emulator is shutting down")
            live = self._live(function)
            free = [i for i in live if i.slots_free > 0]
            if free:
                instance = max(free, key=lambda i: i.last_used)
                instance.slots_free -= 1
                return instance
            if not grace_used and any(i.finishing > 0 for i in live):
                grace_used = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), REUSE_GRACE_S)
                continue
            if len(live) < self.limit(function):
                return await self._spawn(function)
            if not wait:
                raise Throttled(
                    "ReservedFunctionConcurrentInvocationLimitExceeded"
                    if function.reserved_concurrency is not None
                    else "ConcurrentInvocationLimitExceeded"
                )
            await self._changed.wait()

    async def _spawn(self, function: FunctionConfig) -> Instance:
        instance = Instance(function, self.launcher)
        instance.slots_free -= 1
        self.instances[instance.iid] = instance
        listener = self.listeners[instance.iid] = RuntimeListener(self, instance.iid)
        try:
            await listener.start()
            await instance.start(listener.address)
        except BaseException:
            instance.state = InstanceState.DEAD
            self.instances.pop(instance.iid, None)
            self._notify()
            self._close_listener(instance.iid)
            raise
        self._background(pump_output(instance, self.echo))
        self._background(self._watch(instance))
        return instance

    async def invoke(
        self,
        function: FunctionConfig,
        payload: bytes,
        *,
        wait_for_capacity: bool = False,
        client_context: str | None = None,
        request_id: str | None = None,
    ) -> Outcome:
        """Run one invocation to its answer; raises Throttled when none can start.

        `request_id` is given for a retried asynchronous event, which keeps its id.
        """
        instance = await self._acquire(function, wait_for_capacity)
        request_id = request_id or str(uuid.uuid4())
        trace_id = f"Root=1-{int(time.time()):08x}-{uuid.uuid4().hex[:24]};Sampled=0"
        invocation = Invocation(request_id, payload, trace_id, function.arn, client_context)
        instance.assigned[request_id] = invocation
        instance.queue.put_nowait(invocation)
        return await self._supervise(instance, invocation)

    async def _supervise(self, instance: Instance, invocation: Invocation) -> Outcome:
        function = instance.function
        init_limit_s = max(INIT_LIMIT_S, function.timeout_s)
        delivered = asyncio.ensure_future(invocation.delivered.wait())
        waiters: set[asyncio.Future[Any]] = {invocation.result, delivered}
        try:
            await asyncio.wait(waiters, timeout=init_limit_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            delivered.cancel()
        if not invocation.result.done() and not invocation.delivered.is_set():
            message = f"{invocation.request_id} Init timed out after {init_limit_s:.2f} seconds"
            self._finish(instance, invocation, "Sandbox.Timedout", message, status="timeout")
            self.kill(instance)
        if invocation.result.done():
            return invocation.result.result()
        remaining_s = invocation.delivered_at + function.timeout_s - time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(invocation.result), max(0.0, remaining_s))
        except TimeoutError:
            message = (
                f"{invocation.request_id} Task timed out after {function.timeout_s:.2f} seconds"
            )
            self._finish(instance, invocation, "Sandbox.Timedout", message, status="timeout")
            self.kill(instance)
            return invocation.result.result()

    # -- the Runtime API side -------------------------------------------------

    async def next(self, iid: str) -> Invocation | None:
        """Block until the instance's next event; None when it is being stopped."""
        instance = self.instances.get(iid)
        if instance is None or instance.state in (InstanceState.STOPPING, InstanceState.DEAD):
            return None
        if instance.state is InstanceState.STARTING:
            self._background(self._measure(instance))
        if instance.poll() and instance.unreported:
            # The worker is back: the invocation it answered ends here.
            for _ in range(3):  # let the output pump catch up with the last lines
                await asyncio.sleep(0)
            self._end(instance, instance.unreported.popleft())
        self._notify()
        invocation: Invocation | None = await instance.queue.get()
        if invocation is None or invocation.result.done():
            return None
        invocation.delivered_at = time.monotonic()
        invocation.deadline_ms = int((time.time() + instance.function.timeout_s) * 1000)
        invocation.log_offset = instance.log.end
        instance.last_used = invocation.delivered_at
        invocation.delivered.set()
        return invocation

    async def complete(
        self, iid: str, request_id: str, payload: bytes, error_type: str | None
    ) -> bool:
        """A response or error was posted; False when nothing awaits it."""
        instance = self.instances.get(iid)
        invocation = instance.assigned.get(request_id) if instance else None
        if instance is None or invocation is None or not invocation.delivered.is_set():
            return False
        status = None if error_type is None else "error"
        instance.assigned.pop(request_id, None)
        answer(invocation, error_type, payload, status)
        instance.unreported.append(invocation)
        if instance.capacity == 1:
            # Work after the response (a 202'd job) counts against the Timeout, as on Lambda.
            deadline_s = invocation.delivered_at + instance.function.timeout_s
            delay_s = max(0.0, deadline_s - time.monotonic())
            asyncio.get_running_loop().call_later(delay_s, self._overdue, instance, instance.polls)
        return True

    def _overdue(self, instance: Instance, polls: int) -> None:
        if instance.polls == polls and instance.state is InstanceState.RUNNING:
            print(
                f"instance {instance.iid}: work after the response passed the "
                f"{instance.function.timeout_s:g} s timeout; killed",
                file=self.echo,
                flush=True,
            )
            while instance.unreported:
                self._end(instance, instance.unreported.popleft(), status="timeout")
            self.kill(instance)

    def init_failed(self, iid: str, error_type: str, payload: bytes) -> None:
        instance = self.instances.get(iid)
        if instance is not None:
            instance.init_error = (error_type, payload)
            self.kill(instance)

    def _finish(
        self,
        instance: Instance,
        invocation: Invocation,
        error_type: str | None,
        payload: bytes | str,
        *,
        status: str | None,
    ) -> None:
        """Answer and end an invocation at once (a timeout, an exit, an init error)."""
        if invocation.result.done():
            return
        instance.assigned.pop(invocation.request_id, None)
        if isinstance(payload, str):
            payload = error_payload(error_type or "Runtime.Unknown", payload)
        answer(invocation, error_type, payload, status)
        self._end(instance, invocation)

    def _end(self, instance: Instance, invocation: Invocation, status: str | None = None) -> None:
        report = finish(instance, invocation, status=status)
        if report is not None:
            print(report.line(), file=self.out, flush=True)

    async def _measure(self, instance: Instance) -> None:
        """Find the process whose memory the instance's REPORTs give (a container's, late)."""
        instance.memory_pid = instance.pid
        pid = await self.launcher.runtime_pid(instance)
        if pid:
            instance.memory_pid = pid

    # -- lifecycle ------------------------------------------------------------

    def kill(self, instance: Instance) -> None:
        instance.state = InstanceState.STOPPING
        instance.signal(signal.SIGKILL)

    def stop(self, instance: Instance) -> None:
        """Ask politely, then kill: what Lambda does to an environment it retires."""
        if instance.state is InstanceState.DEAD:
            return
        instance.state = InstanceState.STOPPING
        for _ in range(instance.capacity):
            instance.queue.put_nowait(None)
        instance.signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        loop.call_later(STOP_GRACE_S, instance.signal, signal.SIGKILL)

    def _close_listener(self, iid: str) -> None:
        listener = self.listeners.pop(iid, None)
        if listener is not None:
            listener.stop()
            self._background(listener.wait_closed())

    async def _watch(self, instance: Instance) -> None:
        assert instance.process is not None
        code = await instance.process.wait()
        instance.state = InstanceState.DEAD
        self.instances.pop(instance.iid, None)
        instance.exited.set()
        for _ in range(instance.capacity):
            instance.queue.put_nowait(None)  # ends a `next` long-poll the process left behind
        self._close_listener(instance.iid)
        reason = self.launcher.exit_reason(code)
        while instance.unreported:  # answered, but the worker never came back
            self._end(instance, instance.unreported.popleft())
        for invocation in list(instance.assigned.values()):
            if instance.init_error is not None:
                error_type, payload = instance.init_error
                self._finish(instance, invocation, error_type, payload, status="error")
            else:
                message = (
                    f"RequestId: {invocation.request_id} Error: Runtime exited with error: {reason}"
                )
                self._finish(instance, invocation, "Runtime.ExitError", message, status="error")
        self._notify()

    async def reap_idle(self) -> None:
        """Stop instances idle longer than the idle timeout, forever."""
        period_s = min(1.0, max(0.05, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            for instance in list(self.instances.values()):
                if instance.idle and now - instance.idle_since > self.idle_timeout_s:
                    self.stop(instance)

    def begin_shutdown(self) -> None:
        """Stop taking work and signal every instance; safe to call more than once."""
        self.closing = True
        for instance in list(self.instances.values()):
            self.stop(instance)
        self._notify()

    async def shutdown(self) -> None:
        self.begin_shutdown()
        waits = [i.exited.wait() for i in list(self.instances.values())]
        if waits:
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=STOP_GRACE_S)
        stragglers = list(self.instances.values())
        for instance in stragglers:
            instance.signal(signal.SIGKILL)
        if stragglers:
            exits = [asyncio.ensure_future(i.exited.wait()) for i in stragglers]
            await asyncio.wait(exits, timeout=STOP_GRACE_S)
        for iid in list(self.listeners):
            self._close_listener(iid)
        if self._tasks:
            # Listeners close and output pumps drain within a second or so.
            await asyncio.wait(list(self._tasks), timeout=STOP_GRACE_S)
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)

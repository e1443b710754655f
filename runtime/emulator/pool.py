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

from runtime.emulator.instances import Instance, InstanceState, pump_output
from runtime.emulator.invocation import (
    Invocation,
    Outcome,
    Throttled,
    error_payload,
    outcome_of,
)
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
        base_env: Mapping[str, str],
        local_env: Mapping[str, str],
        api_root: str,
        out: IO[str] = sys.stdout,
        echo: IO[str] = sys.stderr,
    ) -> None:
        self.template = template
        self.max_instances = max_instances
        self.idle_timeout_s = idle_timeout_s
        self.base_env = dict(base_env)
        self.local_env = dict(local_env)
        self.api_root = api_root
        self.out = out
        self.echo = echo
        self.instances: dict[str, Instance] = {}
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
        instance = Instance(function)
        instance.slots_free -= 1
        self.instances[instance.iid] = instance
        try:
            await instance.start(self.base_env, self.local_env, self.api_root)
        except BaseException:
            instance.state = InstanceState.DEAD
            self.instances.pop(instance.iid, None)
            self._notify()
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
    ) -> Outcome:
        """Run one invocation to its outcome; raises Throttled when none can start."""
        instance = await self._acquire(function, wait_for_capacity)
        request_id = str(uuid.uuid4())
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
        instance.poll()
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
        # Let the output pump catch up with lines logged just before the post.
        for _ in range(3):
            await asyncio.sleep(0)
        status = None if error_type is None else "error"
        self._finish(instance, invocation, error_type, payload, status=status)
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
        if invocation.result.done():
            return
        instance.assigned.pop(invocation.request_id, None)
        if isinstance(payload, str):
            payload = error_payload(error_type or "Runtime.Unknown", payload)
        outcome = outcome_of(instance, invocation, error_type, payload, status)
        print(outcome.report.line(), file=self.out, flush=True)
        invocation.result.set_result(outcome)

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

    async def _watch(self, instance: Instance) -> None:
        assert instance.process is not None
        code = await instance.process.wait()
        instance.state = InstanceState.DEAD
        self.instances.pop(instance.iid, None)
        instance.exited.set()
        for _ in range(instance.capacity):
            instance.queue.put_nowait(None)  # ends a `next` long-poll the process left behind
        reason = f"signal: {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
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
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)

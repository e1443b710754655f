"""One emulated execution environment: a process, or a container, running the runtime.

A sandbox is started by a launcher: `ProcessLauncher` runs `python -m runtime`
from this interpreter in its own process group (so a kill takes whatever the
handler started with it); `containers.ContainerLauncher` runs an image's
entrypoint; `ric.RicLauncher` runs a Zip function's Python handler under
awslambdaric, a process like `ProcessLauncher`'s. The pool holds one launcher
per PackageType (Image: a process or a container; Zip: awslambdaric), and each
sandbox keeps the one that started it. Either way the sandbox talks to a
Runtime API listener of its own (`AWS_LAMBDA_RUNTIME_API=127.0.0.1:PORT`), and
its combined stdout/stderr is captured: echoed to the emulator's stderr line by
line with an `[sid]` prefix, and kept (the last 64 KB) for `X-Amz-Log-Type:
Tail`. Peak memory is the runtime process's VmHWM.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import IO, TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from runtime.emulator.template import FunctionConfig

LOG_KEEP_BYTES = 64 * 1024
_PR_SET_PDEATHSIG = 1
try:
    _LIBC: Any = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
except OSError:  # pragma: no cover - a libc without prctl
    _LIBC = None


def _die_with_parent() -> None:
    """In the child: be killed when the emulator dies, however it dies."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Launcher(Protocol):
    """How a sandbox's runtime is started, signalled and measured."""

    def command(self, sandbox: Sandbox, api_address: str) -> tuple[list[str], dict[str, str]]:
        """argv and environment of the process the emulator spawns."""
        ...

    def workdir(self, sandbox: Sandbox) -> str | None:
        """The directory the process starts in (None: the emulator's own)."""
        ...

    def signal(self, sandbox: Sandbox, sig: signal.Signals) -> None: ...

    async def runtime_pid(self, sandbox: Sandbox) -> int:
        """The pid whose peak memory is the sandbox's (0 if unknown)."""
        ...

    def exit_reason(self, code: int) -> str:
        """Lambda's words for how the runtime ended: `exit status 3`, `signal: SIGKILL`."""
        ...

    async def remove(self, sandboxes: list[Sandbox]) -> None:
        """Leave nothing of `sandboxes` behind once the emulator stops."""
        ...


def exit_reason(code: int) -> str:
    return f"signal: {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


class ProcessLauncher:
    """`python -m runtime` from this interpreter, with the emulator's environment."""

    def __init__(self, base_env: Mapping[str, str], local_env: Mapping[str, str]) -> None:
        self.base_env = dict(base_env)
        self.local_env = dict(local_env)

    def command(self, sandbox: Sandbox, api_address: str) -> tuple[list[str], dict[str, str]]:
        env = sandbox_env(
            sandbox.function, self.base_env, self.local_env, api_address, sandbox.version
        )
        return [sys.executable, "-m", "runtime"], env

    def workdir(self, sandbox: Sandbox) -> str | None:
        return None

    def signal(self, sandbox: Sandbox, sig: signal.Signals) -> None:
        if sandbox.process is None or sandbox.process.returncode is not None:
            return  # not started, or reaped: its group id may be someone else's by now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(sandbox.process.pid, sig)

    async def runtime_pid(self, sandbox: Sandbox) -> int:
        return sandbox.pid

    def exit_reason(self, code: int) -> str:
        return exit_reason(code)

    async def remove(self, sandboxes: list[Sandbox]) -> None:
        return None  # a process leaves nothing once it has been killed


class SandboxState(StrEnum):
    STARTING = "starting"  # spawned, no `next` yet (the Init phase)
    RUNNING = "running"
    STOPPING = "stopping"  # takes no new invocations
    DEAD = "dead"


@dataclass
class LogBuffer:
    """The tail of a sandbox's output, addressable by absolute byte offset."""

    data: bytearray = field(default_factory=bytearray)
    end: int = 0  # bytes written since the start

    def append(self, chunk: bytes) -> None:
        self.data += chunk
        self.end += len(chunk)
        if len(self.data) > LOG_KEEP_BYTES:
            del self.data[: len(self.data) - LOG_KEEP_BYTES]

    def since(self, offset: int) -> bytes:
        start = max(0, len(self.data) - (self.end - offset))
        return bytes(self.data[start:])


def max_memory_mb(pid: int) -> int:
    """Peak resident memory of `pid` in MB (VmHWM), 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return -(-int(line.split()[1]) // 1024)
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Sandbox:
    """A runtime process and its bookkeeping; the pool owns the policy.

    The sandbox exists (and holds its first reservation) before its process
    does, so concurrent callers never race past the limit while it spawns.
    """

    def __init__(
        self, function: FunctionConfig, launcher: Launcher, version: str = "$LATEST"
    ) -> None:
        self.sid = secrets.token_hex(4)
        self.function = function
        # The version it runs: each version has sandboxes of its own, as on Lambda.
        self.version = version
        self.launcher = launcher
        self.process: asyncio.subprocess.Process | None = None
        # The process whose peak memory the REPORT gives (a container's runtime, once known).
        self.memory_pid = 0
        self.state = SandboxState.STARTING
        self.spawned_at = time.monotonic()
        self.init_ms: float | None = None
        self.capacity = function.max_concurrency
        # Workers not busy and not promised to an invocation.
        self.slots_free = self.capacity
        self._initial_polls = 0
        self.polls = 0
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.assigned: dict[str, Any] = {}
        # Answered invocations whose worker has not asked for its next event yet:
        # their REPORT waits for that `next`, oldest first.
        self.unreported: deque[Any] = deque()
        self.idle_since = time.monotonic()
        self.last_used = 0.0
        self.log = LogBuffer()
        self.init_error: tuple[str, bytes] | None = None
        self.reported_init = False
        self.exited = asyncio.Event()

    async def start(self, api_address: str) -> None:
        """Spawn the runtime, its Runtime API at `api_address` (a plain host:port)."""
        argv, env = self.launcher.command(self, api_address)
        self.spawned_at = time.monotonic()
        self.process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=self.launcher.workdir(self),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.memory_pid = self.process.pid

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def poll(self) -> bool:
        """A worker asks for work: after the first `capacity` polls, one slot is free again.

        True when the poll ends a worker's previous invocation (not one of Init's).
        """
        if self.state is SandboxState.STARTING:
            self.state = SandboxState.RUNNING
            self.init_ms = (time.monotonic() - self.spawned_at) * 1000.0
        self.polls += 1
        returning = self._initial_polls >= self.capacity
        if returning:
            self.slots_free += 1
        else:
            self._initial_polls += 1
        if self.slots_free == self.capacity:
            self.idle_since = time.monotonic()
        return returning

    @property
    def finishing(self) -> int:
        """Workers that answered but have not asked for the next event yet."""
        if self.state is not SandboxState.RUNNING:
            return 0
        return self.capacity - self.slots_free - len(self.assigned)

    @property
    def idle(self) -> bool:
        return self.state is SandboxState.RUNNING and self.slots_free == self.capacity

    def signal(self, sig: signal.Signals) -> None:
        self.launcher.signal(self, sig)


def sandbox_env(
    function: FunctionConfig,
    base: Mapping[str, str],
    local: Mapping[str, str],
    api_address: str,
    version: str = "$LATEST",
) -> dict[str, str]:
    """base < the template's Environment < local wiring < Lambda's platform variables
    (AWS_LAMBDA_FUNCTION_VERSION: the version the sandbox runs)."""
    env = {**base, **function.environment, **local}
    env.update(
        {
            "AWS_LAMBDA_RUNTIME_API": api_address,
            "AWS_LAMBDA_FUNCTION_NAME": function.name,
            "AWS_LAMBDA_FUNCTION_VERSION": version,
            "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(function.memory_mb),
            "AWS_LAMBDA_FUNCTION_TIMEOUT": str(int(function.timeout_s)),
            "AWS_LAMBDA_LOG_GROUP_NAME": f"/aws/lambda/{function.name}",
            "AWS_LAMBDA_INITIALIZATION_TYPE": "on-demand",
            "AWS_EXECUTION_ENV": "AWS_Lambda_Image",
            "AWS_REGION": env.get("AWS_REGION", "us-east-1"),
            "AWS_DEFAULT_REGION": env.get("AWS_DEFAULT_REGION", "us-east-1"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if function.max_concurrency > 1:
        env["AWS_LAMBDA_MAX_CONCURRENCY"] = str(function.max_concurrency)
    else:
        env.pop("AWS_LAMBDA_MAX_CONCURRENCY", None)
    return env


async def pump_output(sandbox: Sandbox, echo: IO[str]) -> None:
    """Capture the sandbox's output until it closes, echoing whole lines."""
    assert sandbox.process is not None and sandbox.process.stdout is not None
    stream = sandbox.process.stdout
    prefix = f"[{sandbox.function.logical_id} {sandbox.sid}] "
    partial = b""
    while chunk := await stream.read(65536):
        sandbox.log.append(chunk)
        *lines, partial = (partial + chunk).split(b"\n")
        for line in lines:
            echo.write(prefix + line.decode("utf-8", "replace") + "\n")
        echo.flush()
    if partial:
        echo.write(prefix + partial.decode("utf-8", "replace") + "\n")
        echo.flush()

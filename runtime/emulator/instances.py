"""One emulated execution environment: a real `python -m runtime` process.

An instance runs in its own process group (so a kill takes whatever the
handler started with it), talks to the emulator's Runtime API under
`/instances/{iid}`, and has its combined stdout/stderr captured: echoed to the
emulator's stderr line by line with an `[iid]` prefix, and kept (the last
64 KB) for `X-Amz-Log-Type: Tail`. Peak memory is the process's VmHWM.
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import IO, TYPE_CHECKING, Any

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


class InstanceState(StrEnum):
    STARTING = "starting"  # spawned, no `next` yet (the Init phase)
    RUNNING = "running"
    STOPPING = "stopping"  # takes no new invocations
    DEAD = "dead"


@dataclass
class LogBuffer:
    """The tail of an instance's output, addressable by absolute byte offset."""

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


class Instance:
    """A runtime process and its bookkeeping; the pool owns the policy.

    The instance exists (and holds its first reservation) before its process
    does, so concurrent callers never race past the limit while it spawns.
    """

    def __init__(self, function: FunctionConfig) -> None:
        self.iid = secrets.token_hex(4)
        self.function = function
        self.process: asyncio.subprocess.Process | None = None
        self.state = InstanceState.STARTING
        self.spawned_at = time.monotonic()
        self.init_ms: float | None = None
        self.capacity = function.max_concurrency
        # Workers not busy and not promised to an invocation.
        self.slots_free = self.capacity
        self._initial_polls = 0
        self.polls = 0
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.assigned: dict[str, Any] = {}
        self.idle_since = time.monotonic()
        self.last_used = 0.0
        self.log = LogBuffer()
        self.init_error: tuple[str, bytes] | None = None
        self.reported_init = False
        self.exited = asyncio.Event()

    async def start(
        self, base_env: Mapping[str, str], local_env: Mapping[str, str], api_root: str
    ) -> None:
        """Spawn `python -m runtime`; its Runtime API is `api_root/instances/{iid}`."""
        env = instance_env(self.function, base_env, local_env, f"{api_root}/instances/{self.iid}")
        self.spawned_at = time.monotonic()
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "runtime",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def poll(self) -> None:
        """A worker asks for work: after the first `capacity` polls, one slot is free again."""
        if self.state is InstanceState.STARTING:
            self.state = InstanceState.RUNNING
            self.init_ms = (time.monotonic() - self.spawned_at) * 1000.0
        self.polls += 1
        if self._initial_polls < self.capacity:
            self._initial_polls += 1
        else:
            self.slots_free += 1
        if self.slots_free == self.capacity:
            self.idle_since = time.monotonic()

    @property
    def finishing(self) -> int:
        """Workers that answered but have not asked for the next event yet."""
        if self.state is not InstanceState.RUNNING:
            return 0
        return self.capacity - self.slots_free - len(self.assigned)

    @property
    def idle(self) -> bool:
        return self.state is InstanceState.RUNNING and self.slots_free == self.capacity

    def signal(self, sig: signal.Signals) -> None:
        if self.process is None or self.process.returncode is not None:
            return  # not started, or reaped: its group id may be someone else's by now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)


def instance_env(
    function: FunctionConfig,
    base: Mapping[str, str],
    local: Mapping[str, str],
    api_address: str,
) -> dict[str, str]:
    """base < the template's Environment < local wiring < Lambda's platform variables."""
    env = {**base, **function.environment, **local}
    env.update(
        {
            "AWS_LAMBDA_RUNTIME_API": api_address,
            "AWS_LAMBDA_FUNCTION_NAME": function.name,
            "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
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


async def pump_output(instance: Instance, echo: IO[str]) -> None:
    """Capture the instance's output until it closes, echoing whole lines."""
    assert instance.process is not None and instance.process.stdout is not None
    stream = instance.process.stdout
    prefix = f"[{instance.function.logical_id} {instance.iid}] "
    partial = b""
    while chunk := await stream.read(65536):
        instance.log.append(chunk)
        *lines, partial = (partial + chunk).split(b"\n")
        for line in lines:
            echo.write(prefix + line.decode("utf-8", "replace") + "\n")
        echo.flush()
    if partial:
        echo.write(prefix + partial.decode("utf-8", "replace") + "\n")
        echo.flush()

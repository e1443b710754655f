"""`thaw emulate --image`: each sandbox is a container of the function's image.

As `sam local start-lambda` does, but with Lambda's execution environment
kept where a container can keep it:

- the image's own entrypoint, bundles and environment, plus the
  template's Environment.Variables, Lambda's platform variables and any other
  THAW_* set where the emulator runs (the laptop's bundle source, cache and
  state paths are not passed: they do not exist in the container);
- Lambda's own non-root user, whatever the image's USER (SANDBOX_USER), so a
  file the function cannot read fails here as it would deployed;
- a read-only root filesystem with a tmpfs /tmp of the function's
  EphemeralStorage, the function's MemorySize as the memory limit, and
  Lambda's limits of 1024 open files and 1024 processes;
- the host network, so the runtime reaches its Runtime API listener at a plain
  `127.0.0.1:PORT`, as on Lambda (the runtime listens on nothing);
- one job store for all sandboxes, as in process mode: a SQLite file in a
  directory of the emulator's, mounted into every container (podman's `:U`
  gives it to the sandbox's user; with docker it is made world-writable).

The engine is podman, or docker where podman is missing. Containers are named
`thaw-<sid>` and labelled `io.thaw.emulate=<emulator pid>`; they are removed
when they stop (`--rm`), and a runtime whose Runtime API goes away exits, so
even an emulator killed outright leaves none running for long.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from signal import Signals

from runtime.emulator.sandboxes import Sandbox, exit_reason, sandbox_env
from runtime.errors import ConfigError

# Lambda runs an image as a least-privileged user of its own, whatever its USER
# says, and that user must be able to read every file the function needs
# (https://docs.aws.amazon.com/lambda/latest/dg/images-create.html, Requirements).
# The uid is not documented; 993:990 is what functions observe (sbx_user1051).
SANDBOX_USER = "993:990"
# Where the shared job store is mounted in every container.
JOBS_MOUNT = "/var/lib/thaw-emulate"
# Lambda's quotas: 1,024 file descriptors and 1,024 processes or threads.
ULIMITS = ("nofile=1024:1024", "nproc=1024:1024")
# Set where the emulator runs, but only meaningful on its own filesystem.
_HOST_ONLY = frozenset({"THAW_JOB_STORE", "THAW_BUNDLE_SOURCE", "THAW_CACHE_DIR", "THAW_STATE_DIR"})


def find_engine(name: str | None = None) -> str:
    """The container CLI: `name`, else podman, else docker; ConfigError if none is here."""
    for candidate in [name] if name else ["podman", "docker"]:
        path = shutil.which(candidate)
        if path:
            return path
    raise ConfigError(f"--image needs {name or 'podman or docker'} on PATH")


def check_image(engine: str, image: str) -> None:
    """ConfigError unless `image` is in the engine's local store (nothing is pulled)."""
    done = subprocess.run(
        [engine, "image", "inspect", image], capture_output=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise ConfigError(f"image {image} is not in {Path(engine).name}'s local store")


class ContainerLauncher:
    """Starts, signals and measures sandboxes that are containers of `image`."""

    def __init__(
        self, engine: str, image: str, local_env: Mapping[str, str], jobs_dir: Path
    ) -> None:
        self.engine = engine
        self.image = image
        self.podman = Path(engine).name.startswith("podman")
        self.local_env = {k: v for k, v in local_env.items() if k not in _HOST_ONLY}
        self.local_env["THAW_JOB_STORE"] = f"sqlite:///{JOBS_MOUNT}/jobs.sqlite3"
        self.jobs_dir = jobs_dir.resolve()
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        if not self.podman:
            # docker has no `:U`; the image's user must be able to write the store.
            self.jobs_dir.chmod(0o777)
        self._tasks: set[asyncio.Task[None]] = set()

    @staticmethod
    def name(sandbox: Sandbox) -> str:
        return f"thaw-{sandbox.sid}"

    def command(self, sandbox: Sandbox, api_address: str) -> tuple[list[str], dict[str, str]]:
        function = sandbox.function
        env = sandbox_env(function, {}, self.local_env, api_address, sandbox.version)
        # Values travel in the engine's own environment, `-e NAME` only on its command
        # line: nothing the function is configured with shows up in `ps`.
        argv = [self.engine, "run", "--rm", "--pull=never", "--name", self.name(sandbox)]
        argv += ["--label", f"io.thaw.emulate={os.getpid()}", "--network", "host"]
        argv += ["--user", SANDBOX_USER]
        argv += ["--read-only", "--tmpfs", f"/tmp:rw,mode=1777,size={function.ephemeral_mb}m"]
        argv += ["--memory", f"{function.memory_mb}m", "--memory-swap", f"{function.memory_mb}m"]
        for ulimit in ULIMITS:
            argv += ["--ulimit", ulimit]
        volume = f"{self.jobs_dir}:{JOBS_MOUNT}"
        argv += ["--volume", f"{volume}:U" if self.podman else volume]
        for key in sorted(env):
            argv += ["--env", key]
        argv.append(self.image)
        # The engine itself needs the host's PATH, HOME and its own settings.
        engine_env = {k: v for k, v in os.environ.items() if k not in env}
        return argv, {**engine_env, **env}

    def workdir(self, sandbox: Sandbox) -> str | None:
        return None  # the engine's client runs anywhere; the image says the container's

    def signal(self, sandbox: Sandbox, sig: Signals) -> None:
        """Signal the container: the engine's client only proxies what it can catch."""
        if sandbox.process is None or sandbox.process.returncode is not None:
            return
        task = asyncio.ensure_future(self._kill(sandbox, sig))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _kill(self, sandbox: Sandbox, sig: Signals) -> None:
        process = await asyncio.create_subprocess_exec(
            self.engine,
            "kill",
            "--signal",
            sig.name,
            self.name(sandbox),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await process.wait()

    async def runtime_pid(self, sandbox: Sandbox) -> int:
        """The container's first process, as the host sees it (0 if it is gone)."""
        process = await asyncio.create_subprocess_exec(
            self.engine,
            "inspect",
            "--format",
            "{{.State.Pid}}",
            self.name(sandbox),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        out, _ = await process.communicate()
        try:
            return int(out.decode().strip() or 0)
        except ValueError:
            return 0

    async def remove(self, sandboxes: list[Sandbox]) -> None:
        """Remove the containers of `sandboxes`, whatever state they are in: `--rm` is
        the engine client's to carry out, and a client that is slow (a busy machine)
        or killed with the emulator leaves its container behind."""
        if not sandboxes:
            return
        argv = [self.engine, "rm", "--force"]
        if self.podman:
            # Without --time, podman's --force first waits a stop timeout; --ignore: a
            # container its client did remove is no error (docker's exit code is ignored).
            argv += ["--time", "0", "--ignore"]
        process = await asyncio.create_subprocess_exec(
            *argv,
            *(self.name(sandbox) for sandbox in sandboxes),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await process.wait()

    def exit_reason(self, code: int) -> str:
        # The engine's client exits 128 + N when the container's process died of signal N.
        if 128 < code < 128 + 65:
            return exit_reason(128 - code)
        return exit_reason(code)

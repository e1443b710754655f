"""`thaw coldstart HANDLER`: where a cold start's time goes.

Starts a fresh `thaw serve` process on a free 127.0.0.1 port (a plain server,
not an emulator instance: the numbers are the runtime's own, without the
emulator's Runtime API hop), then measures

    process start -> healthy    spawn until GET /healthz answers 200
    first invocation            client-observed total, split by the response's
                                Server-Timing into queue, fetch, load, init,
                                warmup and run
    warm invocations            N more, p50 and p99

A handler without a model pays no fetch/load/init/warmup: those phases are
reported as 0 and listed under `phases_absent`. The first invocation asks for
a long wait (`Prefer: wait=600`) so it is answered in one response. The
process is stopped (its whole process group) however the run ends.
"""

from __future__ import annotations

import compileall
import contextlib
import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import orjson

from runtime.errors import ThawError

PHASES = ("queue", "fetch", "load", "init", "warmup", "run")
HEALTHY_TIMEOUT_S = 60.0
FIRST_WAIT_S = 600.0


def parse_server_timing(header: str) -> dict[str, float]:
    """`queue;dur=0.1, fetch;dur=12.0` -> {"queue": 0.1, "fetch": 12.0}; junk is skipped."""
    timings: dict[str, float] = {}
    for metric in header.split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "dur" and name:
                with contextlib.suppress(ValueError):
                    timings[name] = float(value.strip().strip('"'))
    return timings


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def compile_bytecode(modules: Iterable[str]) -> None:
    """Write the missing .pyc files of the packages holding `modules` (and of the
    runtime). Best effort: a read-only install was compiled when installed."""
    packages = {"runtime", *(m.split(".")[0] for m in modules)}
    for package in sorted(packages):
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            compileall.compile_dir(location, quiet=2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class _Server:
    """A `thaw serve` child in its own process group, its output in a temp file."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="thaw-coldstart-", suffix=".log")  # noqa: SIM115
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli.main", "serve", "--port", str(self.port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # fork and exec of the interpreter: the waterfall's first bar.
        self.spawn_ms = (time.monotonic() - self.started) * 1000.0

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def wait_healthy(self, poller: httpx.Client) -> float:
        """Poll /healthz every 5 ms with `poller`, made before the spawn: a new
        client per try costs 30-50 ms (its TLS context), which would both blur
        the figure and take a core from the starting server."""
        deadline = self.started + HEALTHY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ThawError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(httpx.TransportError):
                if poller.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return (time.monotonic() - self.started) * 1000.0
            time.sleep(0.005)
        raise ThawError(f"server not healthy after {HEALTHY_TIMEOUT_S:g} s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10.0)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _invoke(client: httpx.Client, url: str, body: bytes, wait_s: float) -> httpx.Response:
    return client.post(
        url,
        content=body,
        headers={"content-type": "application/json", "prefer": f"wait={wait_s:g}"},
        timeout=wait_s + 30.0,
    )


def measure(
    handler: str, event: Any, runs: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the measurement; the server is stopped before this returns or raises."""
    body = orjson.dumps(event)
    # Both clients are made before the spawn. The caller's has no connection yet:
    # the first invocation pays its connection, as a real caller's does, but not the
    # making of a client (18-31 ms, its TLS context), which would otherwise pass
    # uncounted between the healthy answer and the first request while the server
    # went on starting (loading the framework's libraries).
    with httpx.Client() as poller, httpx.Client() as client:
        server = _Server(env)
        try:
            healthy_ms = server.wait_healthy(poller)
            url = f"{server.url}/invoke/{handler}"
            started = time.monotonic()
            first = _invoke(client, url, body, FIRST_WAIT_S)
            first_ms = (time.monotonic() - started) * 1000.0
            if first.status_code != 200:
                raise ThawError(f"first invocation answered {first.status_code}: {first.text}")
            timings = parse_server_timing(first.headers.get("server-timing", ""))
            warm: list[float] = []
            for _ in range(runs):
                started = time.monotonic()
                response = _invoke(client, url, body, FIRST_WAIT_S)
                warm.append((time.monotonic() - started) * 1000.0)
                if response.status_code != 200:
                    raise ThawError(f"warm invocation answered {response.status_code}")
        finally:
            server.stop()
    return {
        "handler": handler,
        "server": "thaw serve (fresh process, 127.0.0.1)",
        "pid": server.proc.pid,
        "process_start_to_healthy_ms": healthy_ms,
        "first_invocation_ms": first_ms,
        "process_start_to_first_answer_ms": healthy_ms + first_ms,
        "phases_ms": {p: timings.get(p, 0.0) for p in PHASES},
        "phases_absent": [p for p in PHASES if p not in timings],
        "spawn_ms": server.spawn_ms,
        # A batched handler's wait for its batch to start; None: not batched.
        "batch_ms": timings.get("batch"),
        "warm": {
            "runs": len(warm),
            "p50_ms": percentile(warm, 0.50),
            "p99_ms": percentile(warm, 0.99),
        },
    }


def measure_bare(handler: str, event: Any, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The bare script (runtime/cli/bare.py) in a fresh process: spawn -> its answer."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli.bare", handler, orjson.dumps(event).decode()],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # printed as soon as the answer exists
        answered_ms = (time.monotonic() - started) * 1000.0
        errors = proc.stderr.read().decode(errors="replace")
        proc.wait(60.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0 or not line:
        raise ThawError(f"the bare script failed (exit {proc.returncode}):\n{errors[-2000:]}")
    result: dict[str, Any] = orjson.loads(line)
    result["first_answer_ms"] = answered_ms
    return result


_BARE_STEPS = ("import_s", "load_s", "build_s", "run_s")  # seconds, from the bare script


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def compare(
    handler: str, event: Any, runs: int, repeat: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """`repeat` Thaw cold starts interleaved with as many bare scripts; medians and ratio."""
    thaw: list[dict[str, Any]] = []
    bare: list[dict[str, Any]] = []
    for _ in range(max(1, repeat)):
        thaw.append(measure(handler, event, runs, env))
        bare.append(measure_bare(handler, event, env))
    first = [t["process_start_to_first_answer_ms"] for t in thaw]
    floor = [b["first_answer_ms"] for b in bare]
    result = dict(
        min(thaw, key=lambda t: abs(t["process_start_to_first_answer_ms"] - _median(first)))
    )
    result["repeat"] = len(thaw)
    result["process_start_to_first_answer_ms"] = _median(first)
    result["bare"] = {
        "script": "python -m runtime.cli.bare (import, load, build, run once; no server)",
        "first_answer_ms": _median(floor),
        **{
            # In milliseconds, as every other figure of the result is.
            f"{k[:-2]}_ms": _median([b[k] * 1000.0 for b in bare])
            for k in _BARE_STEPS
        },
    }
    result["ratio"] = result["process_start_to_first_answer_ms"] / result["bare"]["first_answer_ms"]
    return result


def render(result: dict[str, Any]) -> str:
    phases = result["phases_ms"]
    absent = result["phases_absent"]
    lines = [
        f"coldstart {result['handler']} ({result['server']})",
        f"  process start -> healthy  {result['process_start_to_healthy_ms']:10.1f} ms",
        f"  first invocation          {result['first_invocation_ms']:10.1f} ms",
    ]
    for phase in PHASES:
        note = "  (not paid: no such phase for this handler)" if phase in absent else ""
        lines.append(f"    {phase:<8}                {phases[phase]:10.1f} ms{note}")
    warm = result["warm"]
    lines.append(
        f"  warm x{warm['runs']:<4}  p50 {warm['p50_ms']:.1f} ms  p99 {warm['p99_ms']:.1f} ms"
    )
    lines.append(
        f"  process start -> first answer {result['process_start_to_first_answer_ms']:6.1f} ms"
    )
    bare = result.get("bare")
    if bare is not None:
        median = (
            f" (medians of {result['repeat']} interleaved runs)" if result["repeat"] > 1 else ""
        )
        lines += [
            f"bare script, same work in a fresh process{median}",
            f"  process start -> first answer {bare['first_answer_ms']:6.1f} ms  (import "
            f"{bare['import_ms']:.1f}, load {bare['load_ms']:.1f}, build {bare['build_ms']:.1f}, "
            f"run {bare['run_ms']:.1f} ms)",
            f"  thaw / bare               {result['ratio']:10.2f}x",
        ]
    return "\n".join(lines)


def run_coldstart(
    handler: str,
    event: Any,
    runs: int,
    as_json: bool,
    bare: bool = False,
    repeat: int = 1,
    waterfall: Path | None = None,
) -> int:
    from runtime.settings import Settings

    compile_bytecode(Settings.from_env().handlers or ("handlers",))
    if bare:
        result = compare(handler, event, max(0, runs), repeat)
    else:
        result = measure(handler, event, max(0, runs))
    print(orjson.dumps(result).decode() if as_json else render(result))
    if waterfall is not None:
        from runtime.cli.waterfall import write

        written = write(result, waterfall)
        # On stderr: stdout stays the one JSON object (or the table) it always was.
        print(f"waterfall: {written[0]} and {written[1]}", file=sys.stderr)
    return 0

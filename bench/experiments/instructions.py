"""Instructions per warm request, counted by callgrind: Thaw against the bare app.

    python bench/experiments/instructions.py           # the ASGI apps in-process (~2 min)
    python bench/experiments/instructions.py --server  # also the real servers (~9 min)
    python bench/experiments/instructions.py --jobs    # the durable job cycle (~1 min)

Over HTTP the warm path's differences are tens of microseconds under noise
of the same size; instruction counts are exact and do not move with the
machine's load, so they show what a change to the warm path is worth. Each
figure is (Ir(M) - Ir(N)) / (M - N): the same process under callgrind with
two request counts, start-up and warm-up cancelling out. In-process, the ASGI
app is called directly (no sockets); with `--server`, the real `thaw serve`
and bare_app.py processes run under callgrind and one keep-alive client
outside it sends the requests. `--jobs` counts Thaw's durable job cycle
(`POST /handlers/echo/jobs`, then `GET /jobs/{id}?wait=5`, its SQLite writes
included; the kernel's share of them is not an instruction callgrind sees),
against two warm `POST /invoke/echo` requests, the same two trips to the app
without a job. Needs valgrind; says so and exits without it.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# `python bench/experiments/instructions.py` puts bench/ on sys.path, not the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import HOST, ROOT, bare_argv, free_port, runtime_env, thaw_serve_argv

BODY = b'{"hello": "world", "n": [1, 2, 3]}'
WARMUP = 200
COUNTS = (300, 1300)
SERVER_COUNTS = (100, 600)
HANDLERS = "handlers.echo,bench.fixtures"
# `--jobs`: what a "path" of the in-process driver may also name.
JOB_CYCLE = "job-cycle"
TWO_INVOKES = "two-invokes"
JOB_COUNTS = (100, 400)
# (label, Thaw's path, the bare app's path)
PAIRS = (
    ("async `echo`", "/invoke/echo", "/invoke/echo"),
    ("sync `echo_sync`", "/invoke/echo_sync", "/thread/echo"),
)


# ---- the child: drive one app in-process ---------------------------------------------


async def _call(app: Any, path: str, method: str = "POST", query: bytes = b"") -> bytes:
    """One request to `app`; its body (the status must be 200, or 202 for a job)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [
            (b"host", b"bench"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
        ],
        "client": (HOST, 1),
        "server": (HOST, 2),
        "state": {},
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Event().wait()  # no disconnect while the request is served
        raise AssertionError("unreachable")

    status: list[int] = []
    body: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        else:
            body.append(message.get("body", b""))

    await app(scope, receive, send)
    if status not in ([200], [202]):
        raise RuntimeError(f"{path}: status {status}")
    return b"".join(body)


async def _job_cycle(app: Any) -> None:
    """Submit a job of `echo`, then long-poll it to its result (the job cycle of
    bench/overhead.py)."""
    import orjson

    job_id = orjson.loads(await _call(app, "/handlers/echo/jobs"))["id"]
    done = orjson.loads(await _call(app, f"/jobs/{job_id}", "GET", b"wait=5"))
    if done["status"] != "succeeded":
        raise RuntimeError(f"job {job_id}: {done}")


async def _two_invokes(app: Any) -> None:
    await _call(app, "/invoke/echo")
    await _call(app, "/invoke/echo")


async def _start_lifespan(app: Any) -> asyncio.Task[None]:
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task = asyncio.create_task(app(scope, inbox.get, outbox.put))
    started = await outbox.get()
    if started["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"lifespan: {started}")
    return task


async def _drive(which: str, path: str, count: int) -> None:
    if which == "thaw":
        from runtime.http.app import create_app
        from runtime.settings import Settings
        from runtime.telemetry.logs import configure_logging

        settings = Settings.from_env()
        # As `thaw serve` logs: JSON lines (the access log's among them) to stderr,
        # here a file beside the job store (callgrind's own report is on fd 2).
        Path(settings.state_dir).mkdir(parents=True, exist_ok=True)
        sys.stderr = open(Path(settings.state_dir) / "server.log", "a")  # noqa: SIM115
        configure_logging(settings.log_level)
        app = create_app(settings)
        lifespan = await _start_lifespan(app)
    else:
        from bench import bare_app

        app, lifespan = bare_app.app, None
    for _ in range(WARMUP + count):
        if path == JOB_CYCLE:
            await _job_cycle(app)
        elif path == TWO_INVOKES:
            await _two_invokes(app)
        else:
            await _call(app, path)
    if lifespan is not None and lifespan.done():
        raise RuntimeError("the app's lifespan ended while it served")
    os._exit(0)  # no teardown: the same for both counts, and slow under valgrind


# ---- the parent: count ------------------------------------------------------------------


def _collected(stderr: str) -> int:
    found = re.search(r"Collected : (\d+)", stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no total:\n{stderr[-2000:]}")
    return int(found.group(1))


def _callgrind(argv: list[str]) -> list[str]:
    return ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv]


def _in_process(which: str, path: str, count: int, env: dict[str, str]) -> int:
    argv = [sys.executable, str(Path(__file__).resolve()), "--drive", which, path, str(count)]
    done = subprocess.run(_callgrind(argv), env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{which} {path}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return _collected(done.stderr)


def _wait_healthz(port: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 300  # start-up under valgrind takes a while
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=5)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                conn.close()
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("server did not answer /healthz within 300 s")


def _server(which: str, path: str, count: int, env: dict[str, str]) -> int:
    port = free_port()
    argv = thaw_serve_argv(port) if which == "thaw" else bare_argv(port)
    # The server's log goes to a file, callgrind's report to another: a pipe read
    # only at the end would fill with access-log lines, and the server block on it.
    state = Path(env["THAW_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    report = state / f"callgrind-{which}-{port}.txt"
    server_log = open(state / f"server-{which}-{port}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [*_callgrind(argv)[:3], f"--log-file={report}", *_callgrind(argv)[3:]],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=server_log,
        text=True,
    )
    try:
        _wait_healthz(port, proc)
        conn = http.client.HTTPConnection(HOST, port, timeout=60)
        for _ in range(WARMUP + count):
            conn.request("POST", path, body=BODY, headers={"content-type": "application/json"})
            reply = conn.getresponse()
            reply.read()
            if reply.status != 200:
                raise RuntimeError(f"{which} {path}: status {reply.status}")
        conn.close()
        proc.send_signal(signal.SIGINT)
        proc.wait(300)
        return _collected(report.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server_log.close()


Measure = Callable[[str, str, int, dict[str, str]], int]


def _per_request(
    measure: Measure, which: str, path: str, counts: tuple[int, int], env: dict[str, str]
) -> float:
    low, high = counts
    return (measure(which, path, high, env) - measure(which, path, low, env)) / (high - low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", action="store_true", help="also count the real servers")
    parser.add_argument(
        "--log-level", default="INFO", help="THAW_LOG_LEVEL (WARNING: no access log)"
    )
    parser.add_argument(
        "--jobs", action="store_true", help="only Thaw's durable job cycle, in-process"
    )
    parser.add_argument("--drive", nargs=3, metavar=("WHICH", "PATH", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        which, path, count = args.drive
        asyncio.run(_drive(which, path, int(count)))
        return
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: nothing to count", file=sys.stderr)
        return
    if args.jobs:
        _jobs(args.log_level)
        return
    modes: list[tuple[str, Measure, tuple[int, int]]] = [("app in-process", _in_process, COUNTS)]
    if args.server:
        modes.append(("whole server", _server, SERVER_COUNTS))
    print("| instructions per request | Thaw | bare | ratio |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="thaw-ir-") as tmp:
        # INFO, as deployed: every request writes its access-log line.
        env = runtime_env(Path(tmp), handlers=HANDLERS, log_level=args.log_level)
        for mode, measure, counts in modes:
            for label, thaw_path, bare_path in PAIRS:
                thaw = _per_request(measure, "thaw", thaw_path, counts, env)
                bare = _per_request(measure, "bare", bare_path, counts, env)
                _row(f"{label}, {mode}", thaw, bare)


def _row(label: str, counted: float, against: float) -> None:
    """One table row: two instruction counts, in thousands, and their ratio."""
    print(
        f"| {label} | {counted / 1000:.0f} k | {against / 1000:.0f} k | {counted / against:.2f}x |",
        flush=True,
    )


def _jobs(log_level: str) -> None:
    """Thaw's durable job cycle against two warm invocations, in-process."""
    print("| instructions per cycle, in-process | Thaw | two warm `echo` invocations | ratio |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="thaw-ir-") as tmp:
        env = runtime_env(Path(tmp), handlers=HANDLERS, log_level=log_level)
        # Every cycle keeps its job: the instance's job quota must not refuse the last ones.
        env["THAW_MAX_JOBS"] = str(10 * (WARMUP + JOB_COUNTS[1]))
        cycle = _per_request(_in_process, "thaw", JOB_CYCLE, JOB_COUNTS, env)
        two = _per_request(_in_process, "thaw", TWO_INVOKES, JOB_COUNTS, env)
        _row("submit -> result (SQLite)", cycle, two)


if __name__ == "__main__":
    main()

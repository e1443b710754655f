"""What every benchmark shares: the result row, statistics, real server processes,
and a lean HTTP/1.1 client.

The client is a few lines over asyncio streams rather than httpx: on a
two-core machine the load generator shares the CPU with the server it
measures, so the cheaper each client request is, the less the client's own
cost shows up in the server's latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


# ---- results ------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the results table."""

    measurement: str
    thaw: str
    baseline: str = "—"
    ratio: str = "—"
    target: str = "—"
    verdict: str = "info"  # pass | FAIL | info | skipped


def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def render(rows: Sequence[Row]) -> str:
    """The rows as one markdown table."""
    lines = [
        "| measurement | Thaw | baseline | ratio | target | pass/fail |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = (r.measurement, r.thaw, r.baseline, r.ratio, r.target, r.verdict)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def table_main(run: Callable[..., Sequence[Row]], doc: str | None) -> None:
    """`python bench/NAME.py [--full]` for a benchmark that bench/run.py also runs:
    its table alone, in quick rounds unless --full (bench/run.py --quick's)."""
    import argparse

    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the full rounds (bench/run.py's)")
    args = parser.parse_args()
    print(render(run(quick=not args.full)))


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def round_ratio(a: Sequence[Any], b: Sequence[Any], field: str) -> float:
    """Median over rounds of a/b in `field`, each round's two windows measured back
    to back: background load drifts, but rarely within one round."""
    return median([getattr(x, field) / getattr(y, field) for x, y in zip(a, b, strict=True)])


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): always one of the observed values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def fmt_s(seconds: float) -> str:
    """A duration in the unit that keeps three significant digits readable: 1.04 ms,
    not 1.0 ms (a figure beside a target of 1.0 ms must show which side it is on)."""
    if math.isnan(seconds):
        return "n/a"
    micros = seconds * 1e6
    if round(abs(micros)) < 1000:
        return f"{micros:.0f} µs"
    ms = seconds * 1e3
    digits = 2 if abs(ms) < 10 else 1 if abs(ms) < 100 else 0
    if round(abs(ms), digits) < 1000:
        return f"{ms:.{digits}f} ms"
    return f"{seconds:.2f} s"


def fmt_x(ratio: float) -> str:
    return "n/a" if math.isnan(ratio) else f"{ratio:.2f}x"


def fmt_bw(bytes_per_s: float) -> str:
    return (
        f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.0f} MB/s"
    )


# ---- processes ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def runtime_env(tmp: Path, **thaw: str) -> dict[str, str]:
    """A clean environment for a runtime process: its state under `tmp`, `THAW_*` from `thaw`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_"))}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(
        {
            "PYTHONPATH": path,
            "PYTHONUNBUFFERED": "1",
            "THAW_CACHE_DIR": str(tmp / "cache"),
            "THAW_STATE_DIR": str(tmp / "state"),
            "THAW_JOB_STORE": f"sqlite:///{tmp / 'jobs.sqlite3'}",
            "THAW_BUNDLE_SOURCE": str(ROOT / "bundles"),
            "THAW_LOG_LEVEL": "INFO",
        }
    )
    env.update({f"THAW_{k.upper()}": v for k, v in thaw.items()})
    return env


def thaw_serve_argv(port: int) -> list[str]:
    """`thaw serve`, as the console script runs it."""
    return [sys.executable, "-m", "runtime.cli.main", "serve", "--port", str(port)]


def bare_argv(port: int) -> list[str]:
    """The bare Starlette+uvicorn baseline (bench/bare_app.py)."""
    return [sys.executable, str(ROOT / "bench" / "bare_app.py"), str(port)]


def _healthz_ok(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            head = sock.recv(64)
    except OSError:
        return False
    return head.startswith(b"HTTP/1.1 200")


class Proc:
    """A server process on 127.0.0.1 that is always stopped (use it as a context manager)."""

    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str],
        port: int,
        log_path: Path,
        cwd: Path = ROOT,
    ) -> None:
        self.argv = argv
        self.env = dict(env)
        self.port = port
        self.log_path = log_path
        # Where it starts: `python -m runtime...` runs the `runtime` found there first.
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it; closed below
        try:
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        return self

    def wait_healthy(self, timeout_s: float = 60.0) -> float:
        """Seconds from just before the process was spawned to its first /healthz 200.

        Polls every 2 ms: a refused connect costs microseconds, so the poller
        takes almost nothing from the starting process.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[1:3]} exited early:\n{self.log()}")
            if _healthz_ok(self.port):
                return time.monotonic() - self.started_at
            time.sleep(0.002)
        raise RuntimeError(f"not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (the runtime drains), then SIGKILL the whole process group."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def __enter__(self) -> Proc:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@contextlib.contextmanager
def stopping(procs: list[Proc]) -> Iterator[list[Proc]]:
    """Stop every process in `procs` (even ones appended later) on the way out."""
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()


# ---- HTTP ---------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    # time.monotonic() and time.time() when the last byte arrived.
    done_at: float
    done_wall: float
    # time.monotonic() before the request was sent (before the connect for `request`).
    started_at: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.done_at - self.started_at


class Conn:
    """One keep-alive HTTP/1.1 connection: requests go one after another."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> Conn:
        self._reader, self._writer = await asyncio.open_connection(HOST, self.port)
        return self

    def send(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> None:
        """Write one request (so many connections can be sent on before any is read)."""
        assert self._writer is not None
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n"
        )
        self._writer.write(head.encode() + body)

    async def receive(self) -> Reply:
        assert self._reader is not None
        head = await self._reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await self._reader.readexactly(int(headers.get("content-length", "0")))
        return Reply(status, headers, body, time.monotonic(), time.time())

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> Reply:
        started = time.monotonic()
        self.send(method, path, body, headers)
        reply = await self.receive()
        reply.started_at = started
        return reply

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
            self._writer = None


async def request(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """One request on a fresh connection, timed from before the connect."""
    started = time.monotonic()
    conn = await Conn(port).open()
    try:
        reply = await conn.request(method, path, body, headers)
    finally:
        await conn.close()
    reply.started_at = started
    return reply


def server_timing(header: str) -> dict[str, float]:
    """`Server-Timing: fetch;dur=1.2, load;dur=3.4` -> {"fetch": 1.2, "load": 3.4} (ms)."""
    timings: dict[str, float] = {}
    for part in header.split(","):
        name, _, params = part.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur" and name:
                timings[name] = float(value)
    return timings


def start_emulator(procs: list[Proc], template: Path, env: Mapping[str, str], log: Path) -> Proc:
    """`thaw emulate` of `template` with one sandbox, on a free port, appended to
    `procs` (so `stopping` stops it), once it says it listens."""
    port = free_port()
    argv = [sys.executable, "-m", "runtime.cli.main", "emulate", "--port", str(port)]
    argv += ["--template", str(template), "--max-sandboxes", "1"]
    emulator = Proc(argv, env, port, log)
    procs.append(emulator.start())
    deadline = time.monotonic() + 60
    while not re.search(r"listening on http://127\.0\.0\.1:\d+", emulator.log()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the emulator did not start:\n{emulator.log()}")
        time.sleep(0.05)
    return emulator


def lambda_client(port: int) -> Any:
    """A boto3 Lambda client of the emulator on `port`: no retries, a long read timeout."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "lambda",
        endpoint_url=f"http://{HOST}:{port}",
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        config=Config(retries={"max_attempts": 1}, read_timeout=600),
    )


def cpu_s(pid: int) -> float:
    """utime + stime of `pid`, seconds (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def minor_faults(pid: int) -> int:
    """Minor page faults of `pid` so far: pages the allocator handed back and took again."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])

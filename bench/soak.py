"""Soak: 100,000 invocations of one `thaw serve`, valid, invalid and oversized mixed.

    .venv/bin/python bench/soak.py [--requests 100000] [--clients 8] [--max-seconds 300]

Several keep-alive clients (the lean asyncio client of bench/common.py) send a
seeded random mix: `echo` and `fahrenheit` (bundles/tempconv, prewarmed)
invocations, async jobs, bad JSON, unknown handlers, bad Prefer headers,
handler InvalidInput, over-deep JSON, and bodies and headers over the limits.
Every answer's status is checked against what its kind must get. The server's
RSS is read from /proc after a warm-up share of the requests and at the end.

Pass: growth under 5 %, zero 5xx, zero unexpected statuses, the server alive.
Prints a markdown table (bench/run.py --write records it in BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    Conn,
    Proc,
    Reply,
    fmt_s,
    free_port,
    percentile,
    runtime_env,
    thaw_serve_argv,
)

MAX_BODY_BYTES = 64 * 1024
GROWTH_LIMIT = 0.05
Row = tuple[str, str]


@dataclass(frozen=True)
class Kind:
    """One kind of request: what is sent, how often, and the status it must get."""

    name: str
    weight: int
    expect: int
    method: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


KINDS = [
    Kind("echo", 38, 200, "POST", "/invoke/echo", b'{"text": "hello", "n": [1, 2, 3]}'),
    Kind("fahrenheit", 20, 200, "POST", "/invoke/fahrenheit", b'{"celsius": [0, 37.5, 100]}'),
    Kind("async job", 2, 202, "POST", "/handlers/echo/jobs", b'{"job": true}'),
    Kind("bad JSON", 8, 400, "POST", "/invoke/echo", b'{"text": "unterminated'),
    Kind("unknown handler", 8, 404, "POST", "/invoke/no-such-handler", b"{}"),
    Kind("bad Prefer", 8, 400, "POST", "/invoke/echo", b"{}", {"Prefer": "wait=soon"}),
    Kind("InvalidInput", 8, 400, "POST", "/invoke/fahrenheit", b'{"celsius": "hot"}'),
    Kind("too deep", 4, 400, "POST", "/invoke/echo", b"[" * 100 + b"]" * 100),
    Kind("body too large", 3, 413, "POST", "/invoke/echo", b" " * (MAX_BODY_BYTES + 1024)),
    Kind("header too large", 1, 400, "POST", "/invoke/echo", b"{}", {"X-Pad": "p" * 70_000}),
]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@dataclass
class Tally:
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    latencies_s: dict[str, list[float]] = field(default_factory=dict)
    reconnects: int = 0
    done: int = 0


async def client(port: int, plan: list[Kind], tally: Tally, counting: bool) -> None:
    conn = await Conn(port).open()
    for kind in plan:
        started = time.perf_counter()
        reply: Reply | None = None
        for _attempt in range(2):
            try:
                conn.send(kind.method, kind.path, kind.body, kind.headers)
                reply = await conn.receive()
                break
            except (ConnectionError, asyncio.IncompleteReadError):
                # The server may close a connection after refusing a body it did not
                # read; that is allowed, so send again on a new one.
                tally.reconnects += 1
                await conn.close()
                conn = await Conn(port).open()
        if reply is None:
            raise RuntimeError(f"{kind.name}: no answer after reconnecting")
        if counting:
            tally.statuses[(kind.name, reply.status)] += 1
            tally.latencies_s.setdefault(kind.name, []).append(time.perf_counter() - started)
        tally.done += 1
        if reply.headers.get("connection", "").lower() == "close":
            await conn.close()
            conn = await Conn(port).open()
    await conn.close()


async def run_share(
    port: int, plan: list[Kind], clients: int, tally: Tally, counting: bool
) -> None:
    await asyncio.gather(*(client(port, plan[i::clients], tally, counting) for i in range(clients)))


@dataclass
class Outcome:
    sent: int = 0
    warmup_n: int = 0
    elapsed_s: float = 0.0
    rss_warm: int = 0
    rss_end: int = 0
    # (requests done after warm-up, RSS bytes) after each slice
    rss_samples: list[tuple[int, int]] = field(default_factory=list)
    alive: bool = True
    stopped_early: bool = False
    log_tail: str = ""


def soak(args: argparse.Namespace, tally: Tally) -> Outcome:
    rng = random.Random(args.seed)
    plan = rng.choices(KINDS, weights=[k.weight for k in KINDS], k=args.requests)
    out = Outcome(warmup_n=int(len(plan) * args.warmup))
    warm_plan, main_plan = plan[: out.warmup_n], plan[out.warmup_n :]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="thaw-soak-") as tmp:
        env = runtime_env(
            Path(tmp),
            handlers="handlers.echo,handlers.tempconv",
            prewarm="tempconv",
            max_body_bytes=str(MAX_BODY_BYTES),
            log_level="WARNING",
        )
        with Proc(thaw_serve_argv(port), env, port, Path(tmp) / "server.log") as server:
            server.wait_healthy()
            assert server.proc is not None
            pid = server.proc.pid
            asyncio.run(wait_ready(port))
            asyncio.run(run_share(port, warm_plan, args.clients, tally, counting=False))
            out.rss_warm = rss_bytes(pid)
            started = time.monotonic()
            # In slices: RSS is sampled between them, and a slow machine stops at
            # --max-seconds with what it did.
            slice_n = max(args.clients, len(main_plan) // 20)
            for offset in range(0, len(main_plan), slice_n):
                if time.monotonic() - started > args.max_seconds:
                    out.stopped_early = True
                    break
                part = main_plan[offset : offset + slice_n]
                asyncio.run(run_share(port, part, args.clients, tally, counting=True))
                out.sent += len(part)
                out.rss_samples.append((out.sent, rss_bytes(pid)))
            out.elapsed_s = time.monotonic() - started
            out.rss_end = rss_bytes(pid)
            out.alive = server.proc.poll() is None
            out.log_tail = server.log()
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def p50_p99(values: list[float]) -> str:
    return f"p50 {fmt_s(percentile(values, 50))}, p99 {fmt_s(percentile(values, 99))}"


def report(args: argparse.Namespace, tally: Tally, out: Outcome) -> tuple[list[Row], bool]:
    growth = (out.rss_end - out.rss_warm) / out.rss_warm
    server_errors = sum(n for (_, status), n in tally.statuses.items() if status >= 500)
    expected = {k.name: k.expect for k in KINDS}
    unexpected = {key: n for key, n in tally.statuses.items() if key[1] != expected[key[0]]}
    ok = out.alive and server_errors == 0 and not unexpected and growth < GROWTH_LIMIT
    every = max(1, len(out.rss_samples) // 5)
    trend = " → ".join(mib(rss) for _, rss in out.rss_samples[every - 1 :: every])
    rows: list[Row] = [
        ("machine", f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, client in-process"),
        (
            "requests after warm-up",
            f"{out.sent:,} in {out.elapsed_s:.1f} s "
            f"({out.sent / out.elapsed_s:,.0f}/s), {args.clients} concurrent clients",
        ),
        ("warm-up requests (not counted)", f"{out.warmup_n:,}"),
        ("RSS after warm-up → end", f"{mib(out.rss_warm)} → {mib(out.rss_end)} MiB"),
        ("RSS growth (limit < 5 %)", f"{growth * 100:+.2f} %"),
        ("RSS every 20 % of the run", f"{trend} MiB"),
        ("5xx answers", str(server_errors)),
        (
            "unexpected statuses",
            str(sum(unexpected.values())) + (f" {unexpected}" if unexpected else ""),
        ),
        ("server alive at the end (no crash)", "yes" if out.alive else "NO"),
        ("reconnects (server closed a connection)", str(tally.reconnects)),
        ("latency, all kinds", p50_p99([s for v in tally.latencies_s.values() for s in v])),
    ]
    for kind in KINDS:
        got = sorted(
            (status, n) for (name, status), n in tally.statuses.items() if name == kind.name
        )
        counts = ", ".join(f"{status}: {n:,}" for status, n in got) or "none"
        rows.append(
            (
                f"{kind.name} (must get {kind.expect})",
                f"{counts}; {p50_p99(tally.latencies_s.get(kind.name, []))}",
            )
        )
    if out.stopped_early:
        rows.append(("stopped early", f"--max-seconds {args.max_seconds:.0f} reached"))
    rows.append(("verdict", "pass" if ok else "FAIL"))
    return rows, ok


def render(rows: list[Row]) -> str:
    lines = ["| measurement | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=0.05, help="share of requests before RSS")
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=8)
    args = parser.parse_args()
    tally = Tally()
    out = soak(args, tally)
    rows, ok = report(args, tally, out)
    table = render(rows)
    print(table)
    if not out.alive:
        print(out.log_tail, file=sys.stderr)
    return 0 if ok else 1


async def wait_ready(port: int, timeout_s: float = 120.0) -> None:
    """Until /readyz is 200: tempconv is prewarmed, so nothing later pays a load."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        conn = await Conn(port).open()
        try:
            if (await conn.request("GET", "/readyz")).status == 200:
                return
        finally:
            await conn.close()
        await asyncio.sleep(0.1)
    raise RuntimeError("the server never became ready")


if __name__ == "__main__":
    sys.exit(main())

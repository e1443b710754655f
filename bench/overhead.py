"""Warm invocation overhead: `echo` over HTTP, Thaw vs a bare Starlette+uvicorn app.

Both are real processes on 127.0.0.1 with the same uvicorn settings; the bare
app calls the same function inline. The load generator runs in this process
(lean keep-alive connections), 1 and 8 concurrent clients, each client sending
its next request when the previous answer arrived. Variants are measured in
alternating slots (Thaw, bare, bare, Thaw, ...) and every ratio is taken
between the two slots of one round, then the median over rounds: background
load on the machine drifts, but rarely within one round.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import (
    Conn,
    Proc,
    Row,
    bare_argv,
    fmt_s,
    fmt_x,
    free_port,
    median,
    percentile,
    runtime_env,
    stopping,
    thaw_serve_argv,
    verdict,
)

BODY = b'{"hello": "world", "n": [1, 2, 3]}'
P50_TARGET = 1.25
RPS_TARGET = 0.8


@dataclass
class Slot:
    """One measurement window of one variant."""

    p50_s: float
    p99_s: float
    rps: float


async def _client(port: int, path: str, until: float, latencies: list[float]) -> None:
    conn = await Conn(port).open()
    try:
        while True:
            started = time.monotonic()
            if started >= until:
                return
            reply = await conn.request("POST", path, BODY)
            if reply.status != 200:
                raise RuntimeError(f"{path} answered {reply.status}: {reply.body[:200]!r}")
            latencies.append(reply.done_at - started)
    finally:
        await conn.close()


async def measure(port: int, path: str, clients: int, duration_s: float) -> Slot:
    latencies: list[float] = []
    started = time.monotonic()
    until = started + duration_s
    await asyncio.gather(*(_client(port, path, until, latencies) for _ in range(clients)))
    elapsed = time.monotonic() - started
    return Slot(percentile(latencies, 50), percentile(latencies, 99), len(latencies) / elapsed)


def _ratio(a: list[Slot], b: list[Slot], field: str) -> float:
    """Median over rounds of a/b, each round's two slots measured back to back."""
    return median([getattr(x, field) / getattr(y, field) for x, y in zip(a, b, strict=True)])


async def _run(thaw_port: int, bare_port: int, rounds: int, duration_s: float) -> list[Row]:
    variants = {
        "thaw": (thaw_port, "/invoke/echo"),
        "bare": (bare_port, "/invoke/echo"),
        "thread": (bare_port, "/thread/echo"),
    }
    for port, path in variants.values():  # warm every path: first calls, thread pools
        await measure(port, path, 8, 0.5)
    rows: list[Row] = []
    for clients in (1, 8):
        slots: dict[str, list[Slot]] = {name: [] for name in variants}
        for index in range(rounds):
            names = list(variants)
            order = names if index % 2 == 0 else names[::-1]
            for name in order:
                port, path = variants[name]
                slots[name].append(await measure(port, path, clients, duration_s))
        thaw, bare, thread = slots["thaw"], slots["bare"], slots["thread"]
        p50_ratio = _ratio(thaw, bare, "p50_s")
        rps_ratio = _ratio(bare, thaw, "rps")  # inverted below: thaw/bare
        rps_ratio = 1 / rps_ratio
        label = f"warm `echo`, {clients} client{'s' if clients > 1 else ''}"
        rows += [
            Row(
                f"{label}: p50 latency",
                fmt_s(median([s.p50_s for s in thaw])),
                fmt_s(median([s.p50_s for s in bare])),
                fmt_x(p50_ratio),
                f"<= {P50_TARGET}x bare",
                verdict(p50_ratio <= P50_TARGET),
            ),
            Row(
                f"{label}: p99 latency",
                fmt_s(median([s.p99_s for s in thaw])),
                fmt_s(median([s.p99_s for s in bare])),
                fmt_x(_ratio(thaw, bare, "p99_s")),
            ),
            Row(
                f"{label}: requests/s",
                f"{median([s.rps for s in thaw]):.0f}",
                f"{median([s.rps for s in bare]):.0f}",
                fmt_x(rps_ratio),
                f">= {RPS_TARGET}x bare",
                verdict(rps_ratio >= RPS_TARGET),
            ),
            Row(
                f"{label}: p50 vs bare + `asyncio.to_thread` (the sync-handler hand-off alone)",
                fmt_s(median([s.p50_s for s in thaw])),
                fmt_s(median([s.p50_s for s in thread])),
                fmt_x(_ratio(thaw, thread, "p50_s")),
            ),
            Row(
                f"{label}: requests/s vs bare + `asyncio.to_thread`",
                f"{median([s.rps for s in thaw]):.0f}",
                f"{median([s.rps for s in thread]):.0f}",
                fmt_x(1 / _ratio(thread, thaw, "rps")),
            ),
        ]
    return rows


def run(*, quick: bool = False) -> list[Row]:
    rounds, duration_s = (4, 0.6) if quick else (8, 1.0)
    with tempfile.TemporaryDirectory(prefix="thaw-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        env = runtime_env(tmp, handlers="handlers.echo")
        thaw_port, bare_port = free_port(), free_port()
        with stopping([]) as procs:
            procs.append(Proc(thaw_serve_argv(thaw_port), env, thaw_port, tmp / "thaw.log").start())
            procs.append(Proc(bare_argv(bare_port), env, bare_port, tmp / "bare.log").start())
            for proc in procs:
                proc.wait_healthy()
            return asyncio.run(_run(thaw_port, bare_port, rounds, duration_s))


if __name__ == "__main__":
    from bench.common import render

    print(render(run()))

"""Warm invocation overhead: a no-op handler over HTTP, Thaw vs a bare Starlette+uvicorn app.

Both are real processes on 127.0.0.1 with the same uvicorn settings, serving
the same function the same way, in two pairs:

- `echo` (`async def`): Thaw runs it on the event loop; the bare app awaits
  it inline;
- `echo_sync` (plain `def`): Thaw runs it in a worker thread so that it cannot
  stall the loop; the bare app calls it in a worker thread of a pool as large
  as Thaw's (64 threads), as Starlette itself runs a sync endpoint in a thread.

The load generator runs in this process
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

import orjson

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
P99_TARGET = 1.5
RPS_TARGET = 0.8
# A durable async job, submitted and its result read (issue 29): an absolute target.
JOB_P50_TARGET_S = 1.0e-3


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


async def _job_cycles(port: int, until: float, cycles: list[float]) -> None:
    """Submit a job of `echo` and long-poll its result, again and again: each cycle
    is the caller's submit -> result time, durable in the job store (SQLite)."""
    conn = await Conn(port).open()
    try:
        while True:
            started = time.monotonic()
            if started >= until:
                return
            submitted = await conn.request("POST", "/handlers/echo/jobs", BODY)
            if submitted.status != 202:
                raise RuntimeError(f"submit answered {submitted.status}: {submitted.body[:200]!r}")
            job_id = orjson.loads(submitted.body)["id"]
            done = await conn.request("GET", f"/jobs/{job_id}?wait=5")
            job = orjson.loads(done.body)
            if done.status != 200 or job["status"] != "succeeded":
                raise RuntimeError(f"job answered {done.status}: {done.body[:200]!r}")
            cycles.append(done.done_at - started)
    finally:
        await conn.close()


async def measure_jobs(port: int, duration_s: float) -> tuple[float, float, int]:
    """p50 and p99 of one client's submit -> result cycles, and their count."""
    cycles: list[float] = []
    await _job_cycles(port, time.monotonic() + duration_s, cycles)
    return percentile(cycles, 50), percentile(cycles, 99), len(cycles)


def _ratio(a: list[Slot], b: list[Slot], field: str) -> float:
    """Median over rounds of a/b, each round's two slots measured back to back."""
    return median([getattr(x, field) / getattr(y, field) for x, y in zip(a, b, strict=True)])


# name -> (server, path); each pair is (Thaw, its bare counterpart).
PAIRS = (
    ("`echo` (async def, on the loop)", "thaw", "/invoke/echo", "bare", "/invoke/echo"),
    (
        "`echo_sync` (def, worker thread)",
        "thaw",
        "/invoke/echo_sync",
        "bare",
        "/thread/echo",
    ),
)


async def _run(ports: dict[str, int], rounds: int, duration_s: float) -> list[Row]:
    variants = {
        f"{server}{path}": (ports[server], path)
        for _, *pair in PAIRS
        for server, path in (pair[:2], pair[2:])
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
        for label, thaw_server, thaw_path, bare_server, bare_path in PAIRS:
            thaw, bare = slots[thaw_server + thaw_path], slots[bare_server + bare_path]
            p50_ratio = _ratio(thaw, bare, "p50_s")
            rps_ratio = 1 / _ratio(bare, thaw, "rps")
            prefix = f"warm {label}, {clients} client{'s' if clients > 1 else ''}"
            rows += [
                Row(
                    f"{prefix}: p50 latency",
                    fmt_s(median([s.p50_s for s in thaw])),
                    fmt_s(median([s.p50_s for s in bare])),
                    fmt_x(p50_ratio),
                    f"<= {P50_TARGET}x bare",
                    verdict(p50_ratio <= P50_TARGET),
                ),
                Row(
                    f"{prefix}: p99 latency",
                    fmt_s(median([s.p99_s for s in thaw])),
                    fmt_s(median([s.p99_s for s in bare])),
                    fmt_x(p99_ratio := _ratio(thaw, bare, "p99_s")),
                    f"<= {P99_TARGET}x bare",
                    verdict(p99_ratio <= P99_TARGET),
                ),
                Row(
                    f"{prefix}: requests/s",
                    f"{median([s.rps for s in thaw]):.0f}",
                    f"{median([s.rps for s in bare]):.0f}",
                    fmt_x(rps_ratio),
                    f">= {RPS_TARGET}x bare",
                    verdict(rps_ratio >= RPS_TARGET),
                ),
            ]
    rows += await _jobs_rows(ports["thaw"], rounds, duration_s)
    return rows


async def _jobs_rows(port: int, rounds: int, duration_s: float) -> list[Row]:
    await measure_jobs(port, 0.5)  # the job path's first calls
    slots = [await measure_jobs(port, duration_s) for _ in range(rounds)]
    p50_s = median([p50 for p50, _, _ in slots])
    return [
        Row(
            "durable async job (SQLite), 1 client: submit -> result p50",
            fmt_s(p50_s),
            target=f"<= {fmt_s(JOB_P50_TARGET_S)}",
            verdict=verdict(p50_s <= JOB_P50_TARGET_S),
        ),
        Row(
            "durable async job (SQLite), 1 client: submit -> result p99",
            fmt_s(median([p99 for _, p99, _ in slots])),
        ),
    ]


def run(*, quick: bool = False) -> list[Row]:
    rounds, duration_s = (4, 0.6) if quick else (12, 1.0)
    with tempfile.TemporaryDirectory(prefix="thaw-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        env = runtime_env(tmp, handlers="handlers.echo,bench.fixtures")
        ports = {"thaw": free_port(), "bare": free_port()}
        with stopping([]) as procs:
            procs.append(
                Proc(thaw_serve_argv(ports["thaw"]), env, ports["thaw"], tmp / "thaw.log").start()
            )
            procs.append(
                Proc(bare_argv(ports["bare"]), env, ports["bare"], tmp / "bare.log").start()
            )
            for proc in procs:
                proc.wait_healthy()
            return asyncio.run(_run(ports, rounds, duration_s))


if __name__ == "__main__":
    from bench.common import render

    print(render(run()))

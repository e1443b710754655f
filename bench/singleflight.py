"""Single flight and the 202 path, against a real `thaw serve` process.

Single flight: 64 connections send their first request to a cold bundle at
once (bench/fixtures.py: the builder sleeps 0.5 s and stamps its end). The
load's end is READY: the builder's end plus the warm-up and ready phase times
from /models; loads are counted by /models too. Each waiter's added latency is
its answer's arrival minus that end, and, split out, its handler's start
minus that end: what the runtime itself adds after the load, before any
HTTP. That runtime part carries the target; the answer's arrival is shown
against its floor, the same fan-out with no runtime in between (a bare
Starlette app whose 64 requests wait on one asyncio.Event set after 0.5 s):
what answering 64 requests at once costs on this machine at all. Both kinds
of handler are measured: `flight_async` (`async def`, woken on the loop) and
`flight` (a plain `def`, each waiter handed to a worker thread).

202: 64 requests at once with `Prefer: wait=0.1` to a cold bundle whose load
takes seconds; each must be answered 202 at once (a job, estimate too long).
The baseline is 64 concurrent `echo` requests to the bare app.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench.common import (
    Conn,
    Proc,
    Reply,
    Row,
    bare_argv,
    fmt_s,
    fmt_x,
    free_port,
    median,
    percentile,
    request,
    runtime_env,
    stopping,
    thaw_serve_argv,
    verdict,
)

WAITERS = 64
LOAD_SLEEP_S = 0.5
ADDED_P99_TARGET_S = 0.005
ACCEPTED_P99_TARGET_S = 0.050


async def burst(
    port: int, path: str, headers: dict[str, str] | None = None, body: bytes = b"{}"
) -> tuple[float, list[Reply]]:
    """Open WAITERS connections, then send one request on each back to back.

    Returns time.time() just before the first send, and every reply (in order
    of arrival per connection).
    """
    conns = [await Conn(port).open() for _ in range(WAITERS)]
    try:
        sent_wall = time.time()
        started = time.monotonic()
        for conn in conns:
            conn.send("POST", path, body, headers)
        replies = await asyncio.gather(*(c.receive() for c in conns))
        for reply in replies:
            reply.started_at = started
        return sent_wall, replies
    finally:
        for conn in conns:
            await conn.close()


async def _model(port: int, name: str) -> dict[str, Any]:
    models = orjson.loads((await request(port, "GET", "/models")).body)
    found: dict[str, Any] = next(m for m in models["models"] if m["name"] == name)
    return found


async def _thaw_round(port: int, handler: str) -> tuple[list[float], list[float], int]:
    """Per waiter: READY -> answer and READY -> handler start; and how many loads ran."""
    loads_before = (await _model(port, "flight"))["loads"]
    _, replies = await burst(port, f"/invoke/{handler}", {"Prefer": "wait=30"})
    bad = [r for r in replies if r.status != 200]
    if bad:
        raise RuntimeError(f"single flight: {bad[0].status} {bad[0].body[:300]!r}")
    model = await _model(port, "flight")
    outputs = [orjson.loads(r.body) for r in replies]
    phases = model["phase_ms"]
    ready_at = outputs[0]["built_at"] + (phases.get("warmup", 0) + phases.get("ready", 0)) / 1000
    answered = [r.done_wall - ready_at for r in replies]
    started = [o["ran_at"] - ready_at for o in outputs]
    # Cold again for the next round (an explicit unload, not an eviction).
    await request(port, "DELETE", "/models/flight")
    return answered, started, model["loads"] - loads_before


async def _bare_round(port: int) -> list[float]:
    await request(port, "DELETE", "/fanout")
    _, replies = await burst(port, f"/fanout?after={LOAD_SLEEP_S}")
    set_at = orjson.loads(replies[0].body)["set_at"]
    return [r.done_wall - set_at for r in replies]


async def _accepted(thaw_port: int, bare_port: int, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds to each 202 (Thaw) and to each 200 of 64 concurrent echo calls (bare)."""
    thaw: list[float] = []
    bare: list[float] = []
    for index in range(rounds):
        for name in ("thaw", "bare") if index % 2 == 0 else ("bare", "thaw"):
            if name == "thaw":
                _, replies = await burst(thaw_port, "/invoke/slow", {"Prefer": "wait=0.1"})
                if any(r.status != 202 for r in replies):
                    statuses = sorted({r.status for r in replies})
                    raise RuntimeError(f"202 path: statuses {statuses}")
                thaw += [r.wall_s for r in replies]
                await asyncio.sleep(0.2)
            else:
                _, replies = await burst(bare_port, "/invoke/echo")
                bare += [r.wall_s for r in replies]
    return thaw, bare


HANDLERS = {"flight_async": "async def", "flight": "def, worker thread"}


async def _run(thaw_port: int, bare_port: int, rounds: int) -> list[Row]:
    answered: dict[str, list[float]] = {name: [] for name in HANDLERS}
    started: dict[str, list[float]] = {name: [] for name in HANDLERS}
    loads: list[int] = []
    bare_all: list[float] = []
    for index in range(rounds):
        names = ["bare", *HANDLERS]
        for name in names if index % 2 == 0 else names[::-1]:
            if name == "bare":
                bare_all += await _bare_round(bare_port)
                continue
            added, begun, n = await _thaw_round(thaw_port, name)
            answered[name] += added
            started[name] += begun
            loads.append(n)
    accepted, bare_200 = await _accepted(thaw_port, bare_port, rounds)
    accepted_p99 = percentile(accepted, 99)
    bare_p99 = percentile(bare_all, 99)
    rows = [
        Row(
            f"single flight: {WAITERS} concurrent first requests -> loads (per round)",
            ", ".join(str(n) for n in loads),
            target="1",
            verdict=verdict(all(n == 1 for n in loads)),
        )
    ]
    for name, kind in HANDLERS.items():
        runtime_p99 = percentile(started[name], 99)
        label = f"single flight, `{name}` ({kind}), {rounds} x {WAITERS} waiters"
        rows += [
            Row(
                f"{label}: added latency, READY -> handler running (the runtime's part), p50 / p99",
                f"{fmt_s(median(started[name]))} / {fmt_s(runtime_p99)}",
                target=f"p99 <= {fmt_s(ADDED_P99_TARGET_S)}",
                verdict=verdict(runtime_p99 <= ADDED_P99_TARGET_S),
            ),
            Row(
                f"{label}: added latency, READY -> answer received (with HTTP), p50 / p99",
                f"{fmt_s(median(answered[name]))} / {fmt_s(percentile(answered[name], 99))}",
                f"{fmt_s(median(bare_all))} / {fmt_s(bare_p99)} bare fan-out",
                fmt_x(percentile(answered[name], 99) / bare_p99) + " (p99)",
            ),
        ]
    rows += [
        Row(
            f"202 with `Prefer: wait=0.1`, {WAITERS} concurrent, cold bundle: p99 time to answer",
            fmt_s(accepted_p99),
            f"{fmt_s(percentile(bare_200, 99))} bare, {WAITERS} concurrent echo",
            fmt_x(accepted_p99 / percentile(bare_200, 99)),
            f"<= {fmt_s(ACCEPTED_P99_TARGET_S)}",
            verdict(accepted_p99 <= ACCEPTED_P99_TARGET_S),
        ),
        Row(
            f"202 with `Prefer: wait=0.1`, {WAITERS} concurrent: p50 time to answer",
            fmt_s(median(accepted)),
            f"{fmt_s(median(bare_200))} bare",
            fmt_x(median(accepted) / median(bare_200)),
        ),
    ]
    return rows


def run(*, quick: bool = False) -> list[Row]:
    from tests.support import make_bundle

    rounds = 2 if quick else 4
    with tempfile.TemporaryDirectory(prefix="thaw-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        bundles = tmp / "bundles"
        make_bundle(bundles, "flight", config={"sleep_s": LOAD_SLEEP_S})
        make_bundle(bundles, "slow", config={"sleep_s": 6.0})
        env = runtime_env(
            tmp,
            handlers="bench.fixtures",
            bundle_source=str(bundles),
            drain_grace_s="1",
            # Every round's 64 jobs stay queued behind beta's load; none may be refused.
            max_queue="1024",
        )
        thaw_port, bare_port = free_port(), free_port()
        with stopping([]) as procs:
            procs.append(Proc(thaw_serve_argv(thaw_port), env, thaw_port, tmp / "thaw.log").start())
            procs.append(Proc(bare_argv(bare_port), env, bare_port, tmp / "bare.log").start())
            for proc in procs:
                proc.wait_healthy()
            return asyncio.run(_run(thaw_port, bare_port, rounds))


if __name__ == "__main__":
    from bench.common import render

    print(render(run(quick=True)))

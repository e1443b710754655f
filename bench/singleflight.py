"""Single flight and the 202 path, against a real `thaw serve` process.

Single flight: 64 connections send their first request to a cold bundle at
once (bench/fixtures.py: the builder sleeps 0.5 s and stamps its end). The
load's end is READY: the builder's end plus the warm-up and ready phase times
from /models; loads are counted by /models too. Each waiter's added latency is
its answer's arrival minus that end, and, split out, its handler's start
minus that end: what the runtime itself adds after the load, before any
HTTP. That runtime part carries the target. Both are shown against their
floor, the same fan-out with no runtime in between: a bare Starlette app whose
64 requests wait on one asyncio.Event set after 0.5 s and then stamp when they
run, on the loop or, for the plain-`def` handler, in a worker thread of a pool
as large as Thaw's. Both kinds of handler are measured: `flight_async`
(`async def`, woken on the loop) and `flight` (a plain `def`, each waiter
handed to a worker thread).

202: 64 requests at once with `Prefer: wait=0.1` to a cold bundle whose load
takes seconds; each must be answered 202 at once (a job, estimate too long).
The baseline is 64 concurrent `echo` requests to the bare app. The same bursts
go first to a fresh instance, one nothing has touched (shown, no target): its
first burst reads the manifest and starts the instance's first load, and the
bursts after it arrive while that load imports the framework.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

# `python bench/singleflight.py` puts bench/ on sys.path, not the repository root.
ROOT_DIR = Path(__file__).resolve().parent.parent
if str(ROOT_DIR) not in sys.path:
    sys.path.insert(0, str(ROOT_DIR))

from bench.common import (  # noqa: E402
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


async def _bare_round(port: int, thread: bool) -> tuple[list[float], list[float]]:
    """Per waiter of the bare fan-out: set -> answer, set -> running (in a thread if `thread`)."""
    await request(port, "DELETE", "/fanout")
    query = f"after={LOAD_SLEEP_S}" + ("&thread=1" if thread else "")
    _, replies = await burst(port, f"/fanout?{query}")
    outputs = [orjson.loads(r.body) for r in replies]
    set_at = outputs[0]["set_at"]
    return [r.done_wall - set_at for r in replies], [o["ran_at"] - set_at for o in outputs]


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


async def _fresh(port: int, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds to each 202 on a fresh instance: the first burst, and the bursts after it.

    Nothing has touched the instance: the first burst's requests read the
    bundle's manifest for their estimate and start the instance's first load,
    which imports the framework in a worker thread while the later bursts
    arrive.
    """
    first: list[float] = []
    during: list[float] = []
    for index in range(rounds):
        _, replies = await burst(port, "/invoke/slow", {"Prefer": "wait=0.1"})
        if any(r.status != 202 for r in replies):
            statuses = sorted({r.status for r in replies})
            raise RuntimeError(f"202 path, fresh instance: statuses {statuses}")
        (first if index == 0 else during).extend(r.wall_s for r in replies)
        await asyncio.sleep(0.2)
    return first, during


# Each handler and whether its bare counterpart hands the waiter to a thread.
HANDLERS = {"flight_async": ("async def", False), "flight": ("def, worker thread", True)}


async def _run(thaw_port: int, bare_port: int, fresh_port: int, rounds: int) -> list[Row]:
    # First, while the other two servers idle: the fresh instance's bursts.
    fresh_first, fresh_during = await _fresh(fresh_port, rounds)
    answered: dict[str, list[float]] = {name: [] for name in HANDLERS}
    started: dict[str, list[float]] = {name: [] for name in HANDLERS}
    bare_answered: dict[str, list[float]] = {name: [] for name in HANDLERS}
    bare_started: dict[str, list[float]] = {name: [] for name in HANDLERS}
    loads: list[int] = []
    for index in range(rounds):
        slots = [(name, bare) for name in HANDLERS for bare in (True, False)]
        for name, bare in slots if index % 2 == 0 else slots[::-1]:
            if bare:
                added, begun = await _bare_round(bare_port, thread=HANDLERS[name][1])
                bare_answered[name] += added
                bare_started[name] += begun
                continue
            added, begun, n = await _thaw_round(thaw_port, name)
            answered[name] += added
            started[name] += begun
            loads.append(n)
    accepted, bare_200 = await _accepted(thaw_port, bare_port, rounds)
    accepted_p99 = percentile(accepted, 99)
    rows = [
        Row(
            f"single flight: {WAITERS} concurrent first requests -> loads (per round)",
            ", ".join(str(n) for n in loads),
            target="1",
            verdict=verdict(all(n == 1 for n in loads)),
        )
    ]
    for name, (kind, thread) in HANDLERS.items():
        runtime_p99 = percentile(started[name], 99)
        floor = "bare fan-out to threads" if thread else "bare fan-out"
        label = f"single flight, `{name}` ({kind}), {rounds} x {WAITERS} waiters"
        rows += [
            Row(
                f"{label}: added latency, READY -> handler running (the runtime's part), p50 / p99",
                f"{fmt_s(median(started[name]))} / {fmt_s(runtime_p99)}",
                f"{fmt_s(median(bare_started[name]))} / "
                f"{fmt_s(percentile(bare_started[name], 99))} {floor}",
                fmt_x(runtime_p99 / percentile(bare_started[name], 99)) + " (p99)",
                f"p99 <= {fmt_s(ADDED_P99_TARGET_S)}",
                verdict(runtime_p99 <= ADDED_P99_TARGET_S),
            ),
            Row(
                f"{label}: added latency, READY -> answer received (with HTTP), p50 / p99",
                f"{fmt_s(median(answered[name]))} / {fmt_s(percentile(answered[name], 99))}",
                f"{fmt_s(median(bare_answered[name]))} / "
                f"{fmt_s(percentile(bare_answered[name], 99))} {floor}",
                fmt_x(percentile(answered[name], 99) / percentile(bare_answered[name], 99))
                + " (p99)",
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
        Row(
            f"202, fresh instance (nothing loaded yet): first burst of {WAITERS}, p99",
            fmt_s(percentile(fresh_first, 99)),
            f"{fmt_s(percentile(bare_200, 99))} bare, {WAITERS} concurrent echo",
            fmt_x(percentile(fresh_first, 99) / percentile(bare_200, 99)),
        ),
        Row(
            f"202, fresh instance: the next {rounds - 1} bursts of {WAITERS}, while its first "
            "load imports the framework in a worker thread, p99",
            fmt_s(percentile(fresh_during, 99)),
            f"{fmt_s(percentile(bare_200, 99))} bare, {WAITERS} concurrent echo",
            fmt_x(percentile(fresh_during, 99) / percentile(bare_200, 99)),
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
        fresh_env = runtime_env(
            tmp / "fresh",
            handlers="bench.fixtures",
            bundle_source=str(bundles),
            drain_grace_s="1",
            max_queue="1024",
        )
        thaw_port, bare_port, fresh_port = free_port(), free_port(), free_port()
        with stopping([]) as procs:
            procs.append(Proc(thaw_serve_argv(thaw_port), env, thaw_port, tmp / "thaw.log").start())
            procs.append(Proc(bare_argv(bare_port), env, bare_port, tmp / "bare.log").start())
            procs.append(
                Proc(thaw_serve_argv(fresh_port), fresh_env, fresh_port, tmp / "fresh.log").start()
            )
            for proc in procs:
                proc.wait_healthy()
            return asyncio.run(_run(thaw_port, bare_port, fresh_port, rounds))


if __name__ == "__main__":
    from bench.common import table_main

    table_main(run, __doc__)

"""Warm invocation overhead (a no-op over HTTP, Thaw vs a bare Starlette app); single flight.

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

Each variant runs as `--processes` server processes (3 by default), round i
measuring the i-th modulo that count: two processes of the same code differ
by up to 5-7 % in CPU per request here (where their objects and code land in
memory), a difference one process per variant would carry into every round
of the run as if it were the code's.

**Single flight and the 202 path** (`--singleflight`; bench/run.py's `singleflight`),
against a real `thaw serve` process.

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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import orjson

# `python bench/overhead.py` puts bench/ on sys.path, not the repository root.
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
    round_ratio,
    runtime_env,
    stopping,
    thaw_serve_argv,
    verdict,
)

BODY = b'{"hello": "world", "n": [1, 2, 3]}'
# RunPod's request: the same event as its `input`.
RUNPOD_BODY = b'{"input": ' + BODY + b"}"
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


async def _client(port: int, path: str, body: bytes, until: float, latencies: list[float]) -> None:
    conn = await Conn(port).open()
    try:
        while True:
            started = time.monotonic()
            if started >= until:
                return
            reply = await conn.request("POST", path, body)
            if reply.status != 200:
                raise RuntimeError(f"{path} answered {reply.status}: {reply.body[:200]!r}")
            latencies.append(reply.done_at - started)
    finally:
        await conn.close()


async def measure(
    port: int, path: str, clients: int, duration_s: float, body: bytes = BODY
) -> Slot:
    latencies: list[float] = []
    started = time.monotonic()
    until = started + duration_s
    await asyncio.gather(*(_client(port, path, body, until, latencies) for _ in range(clients)))
    elapsed = time.monotonic() - started
    return Slot(percentile(latencies, 50), percentile(latencies, 99), len(latencies) / elapsed)


async def thaw_job_cycle(conn: Conn, body: bytes = BODY) -> None:
    """Submit a job of `echo`, then long-poll its result: durable in SQLite."""
    submitted = await conn.request("POST", "/handlers/echo/jobs", body)
    if submitted.status != 202:
        raise RuntimeError(f"submit answered {submitted.status}: {submitted.body[:200]!r}")
    job_id = orjson.loads(submitted.body)["id"]
    done = await conn.request("GET", f"/jobs/{job_id}?wait=5")
    if done.status != 200 or orjson.loads(done.body)["status"] != "succeeded":
        raise RuntimeError(f"job answered {done.status}: {done.body[:200]!r}")


async def _runpod_cycle(conn: Conn) -> None:
    """RunPod's local worker: `/run` keeps the job in memory, `/status/{id}` runs it."""
    submitted = await conn.request("POST", "/run", RUNPOD_BODY)
    job_id = orjson.loads(submitted.body)["id"]
    done = await conn.request("POST", f"/status/{job_id}")
    if done.status != 200 or orjson.loads(done.body)["status"] != "COMPLETED":
        raise RuntimeError(f"job answered {done.status}: {done.body[:200]!r}")


async def measure_jobs(port: int, duration_s: float, runpod: bool = False) -> Slot:
    """One client's submit -> result cycles, again and again: p50, p99, cycles/s."""
    cycle = _runpod_cycle if runpod else thaw_job_cycle
    cycles: list[float] = []
    conn = await Conn(port).open()
    started = time.monotonic()
    until = started + duration_s
    try:
        while (begun := time.monotonic()) < until:
            await cycle(conn)
            cycles.append(time.monotonic() - begun)
    finally:
        await conn.close()
    elapsed = time.monotonic() - started
    return Slot(percentile(cycles, 50), percentile(cycles, 99), len(cycles) / elapsed)


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


async def _run(
    ports: dict[str, list[int]], rounds: int, duration_s: float, jobs_only: bool = False
) -> list[Row]:
    if jobs_only:
        return await _jobs_rows(ports, rounds, duration_s)
    variants = {
        f"{server}{path}": (ports[server], path, BODY)
        for _, *pair in PAIRS
        for server, path in (pair[:2], pair[2:])
    }
    if "runpod" in ports:
        variants["runpod/runsync"] = (ports["runpod"], "/runsync", RUNPOD_BODY)
    for each, path, body in variants.values():  # warm every path: first calls, thread pools
        for port in each:
            await measure(port, path, 8, 0.5, body)
    rows: list[Row] = []
    for clients in (1, 8):
        slots: dict[str, list[Slot]] = {name: [] for name in variants}
        for index in range(rounds):
            names = list(variants)
            order = names if index % 2 == 0 else names[::-1]
            for name in order:
                each, path, body = variants[name]
                port = each[index % len(each)]
                slots[name].append(await measure(port, path, clients, duration_s, body))
        for label, thaw_server, thaw_path, bare_server, bare_path in PAIRS:
            thaw, bare = slots[thaw_server + thaw_path], slots[bare_server + bare_path]
            rows += _pair_rows(f"warm {label}, {_clients(clients)}", thaw, bare)
        if "runpod/runsync" in slots:
            thaw, runpod = slots["thaw/invoke/echo"], slots["runpod/runsync"]
            rows += _runpod_rows(
                f"warm `echo` vs RunPod `/runsync`, {_clients(clients)}", thaw, runpod
            )
    rows += await _jobs_rows(ports, rounds, duration_s)
    return rows


def _clients(count: int) -> str:
    return f"{count} client{'s' if count > 1 else ''}"


def _pair_rows(prefix: str, thaw: list[Slot], bare: list[Slot]) -> list[Row]:
    p50_ratio = round_ratio(thaw, bare, "p50_s")
    p99_ratio = round_ratio(thaw, bare, "p99_s")
    rps_ratio = 1 / round_ratio(bare, thaw, "rps")
    return [
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
            fmt_x(p99_ratio),
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


def _runpod_rows(prefix: str, thaw: list[Slot], runpod: list[Slot]) -> list[Row]:
    """Thaw against RunPod's worker (baseline column: RunPod), for information."""
    return [
        Row(
            f"{prefix}: {what}",
            fmt(median([getattr(s, field) for s in thaw])),
            fmt(median([getattr(s, field) for s in runpod])),
            fmt_x(round_ratio(thaw, runpod, field)),
        )
        for what, field, fmt in (
            ("p50 latency", "p50_s", fmt_s),
            ("p99 latency", "p99_s", fmt_s),
            ("requests/s", "rps", lambda v: f"{v:.0f}"),
        )
    ]


async def _jobs_rows(ports: dict[str, list[int]], rounds: int, duration_s: float) -> list[Row]:
    """Submit -> result, one client; Thaw's and (if it runs) RunPod's in alternate slots."""
    arms = {"thaw": False} | ({"runpod": True} if "runpod" in ports else {})
    for name, is_runpod in arms.items():  # the job path's first calls
        for port in ports[name]:
            await measure_jobs(port, 0.5, is_runpod)
    slots: dict[str, list[Slot]] = {name: [] for name in arms}
    for index in range(rounds):
        names = list(arms) if index % 2 == 0 else list(arms)[::-1]
        for name in names:
            port = ports[name][index % len(ports[name])]
            slots[name].append(await measure_jobs(port, duration_s, arms[name]))
    thaw = slots["thaw"]
    p50_s = median([s.p50_s for s in thaw])
    runpod = slots.get("runpod")
    base = "—" if runpod is None else fmt_s(median([s.p50_s for s in runpod]))
    base99 = "—" if runpod is None else fmt_s(median([s.p99_s for s in runpod]))
    return [
        Row(
            "durable async job (SQLite), 1 client: submit -> result p50"
            + ("" if runpod is None else " (baseline: RunPod /run -> /status, in memory)"),
            fmt_s(p50_s),
            base,
            "—" if runpod is None else fmt_x(round_ratio(thaw, runpod, "p50_s")),
            f"<= {fmt_s(JOB_P50_TARGET_S)}",
            verdict(p50_s <= JOB_P50_TARGET_S),
        ),
        Row(
            "durable async job (SQLite), 1 client: submit -> result p99",
            fmt_s(median([s.p99_s for s in thaw])),
            base99,
            "—" if runpod is None else fmt_x(round_ratio(thaw, runpod, "p99_s")),
        ),
    ]


def _runpod_argv(python: str, port: int) -> list[str]:
    return [python, str(Path(__file__).with_name("bare_app.py")), "--runpod", str(port)]


def run(
    *,
    quick: bool = False,
    runpod_python: str | None = None,
    log_level: str = "INFO",
    jobs_only: bool = False,
    processes: int = 3,
) -> list[Row]:
    """`runpod_python`: a Python with the `runpod` package, to add RunPod's worker;
    `log_level`: Thaw's THAW_LOG_LEVEL (INFO, as deployed, writes the access log);
    `jobs_only`: the job cycle's rows alone; `processes`: server processes per
    variant, taking the rounds in turn (see the module docstring)."""
    rounds, duration_s = (4, 0.6) if quick else (12, 1.0)
    with tempfile.TemporaryDirectory(prefix="thaw-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        ports: dict[str, list[int]] = {}
        with stopping([]) as procs:
            for index in range(processes):
                # Each its own job store and state: one instance each, as measured.
                # The job cycles store tens of thousands of jobs: past the default
                # stored-job quota (THAW_MAX_JOBS), which is not what is measured.
                env = runtime_env(
                    tmp / str(index),
                    handlers="handlers.echo,bench.fixtures",
                    log_level=log_level,
                    max_jobs="10000000",
                )
                servers = {"thaw": thaw_serve_argv, "bare": bare_argv}
                if runpod_python:
                    servers["runpod"] = partial(_runpod_argv, runpod_python)
                for name, argv in servers.items():
                    port = free_port()
                    ports.setdefault(name, []).append(port)
                    log = tmp / f"{name}-{index}.log"
                    procs.append(Proc(argv(port), env, port, log).start())
            for proc in procs:
                proc.wait_healthy()
            return asyncio.run(_run(ports, rounds, duration_s, jobs_only))


# ---- single flight and the 202 path ----

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


async def _flight_run(thaw_port: int, bare_port: int, fresh_port: int, rounds: int) -> list[Row]:
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


def run_singleflight(*, quick: bool = False) -> list[Row]:
    """The single-flight and 202 rows (the module docstring's second part)."""
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
            return asyncio.run(_flight_run(thaw_port, bare_port, fresh_port, rounds))


if __name__ == "__main__":
    import argparse

    from bench.common import render

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds of 0.6 s, not 12 of 1 s")
    parser.add_argument(
        "--runpod-python",
        metavar="PYTHON",
        help="a Python with `pip install runpod`: RunPod's worker measured beside Thaw",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="Thaw's THAW_LOG_LEVEL (WARNING: no access log, to see what it costs)",
    )
    parser.add_argument("--jobs-only", action="store_true", help="only the job cycle's rows")
    parser.add_argument(
        "--singleflight",
        action="store_true",
        help="the single-flight and 202 rows instead (--quick: 2 rounds, not 4)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=3,
        help="server processes per variant, taking the rounds in turn (default 3)",
    )
    args = parser.parse_args()
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if args.singleflight:
        print(render(run_singleflight(quick=args.quick)))
        raise SystemExit(0)
    rows = run(
        quick=args.quick,
        runpod_python=args.runpod_python,
        log_level=args.log_level,
        jobs_only=args.jobs_only,
        processes=args.processes,
    )
    print(render(rows))

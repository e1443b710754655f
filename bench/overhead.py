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

Each variant runs as `--processes` server processes (3 by default), round i
measuring the i-th modulo that count: two processes of the same code differ
by up to 5-7 % in CPU per request here (where their objects and code land in
memory), a difference one process per variant would carry into every round
of the run as if it were the code's.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import orjson

# `python bench/overhead.py` puts bench/ on sys.path, not the repository root.
ROOT_DIR = Path(__file__).resolve().parent.parent
if str(ROOT_DIR) not in sys.path:
    sys.path.insert(0, str(ROOT_DIR))

from bench.common import (  # noqa: E402
    Conn,
    Proc,
    Row,
    bare_argv,
    fmt_s,
    fmt_x,
    free_port,
    median,
    percentile,
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
    return [python, str(Path(__file__).with_name("runpod_worker.py")), str(port)]


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
        "--processes",
        type=int,
        default=3,
        help="server processes per variant, taking the rounds in turn (default 3)",
    )
    args = parser.parse_args()
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    rows = run(
        quick=args.quick,
        runpod_python=args.runpod_python,
        log_level=args.log_level,
        jobs_only=args.jobs_only,
        processes=args.processes,
    )
    print(render(rows))
